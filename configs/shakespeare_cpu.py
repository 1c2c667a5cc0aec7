# `python train.py` on a machine without a GPU: a 4-layer GPT on tiny shakespeare that trains in about a minute on a
# laptop's CPU (with a GPU the default is configs/shakespeare.py, GPT-2 124M).
#   python train.py configs/shakespeare_cpu.py
data_dir = "data/shakespeare"
device = "cpu"
wandb = False  # a first run needs no account; --wandb=true logs it (offline without a key)

n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
attn = "sdpa"

batch_size = 16
max_steps = 100
learning_rate = 2e-3
min_lr = 2e-4
warmup_steps = 10

eval_interval = 50
eval_iters = 4
sample_interval = 100
sample_tokens = 64
sample_prompt = "ROMEO:"
log_interval = 10
checkpoint_interval = 0  # only at the end (and on SIGINT/SIGTERM)
