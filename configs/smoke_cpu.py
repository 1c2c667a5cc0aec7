# A tiny GPT on tiny shakespeare, on the CPU in well under a minute: checks that the whole
# pipeline (data, model, optimizer, eval, samples, checkpoint, metrics) runs end to end.
#   python -m data.shakespeare && python train.py configs/smoke_cpu.py
data_dir = "data/shakespeare"
device = "cpu"
wandb = False

n_layer = 2
n_head = 4
n_embd = 64
block_size = 64
attn = "sdpa"

batch_size = 8
max_steps = 40
learning_rate = 3e-3
min_lr = 3e-4
warmup_steps = 5

eval_interval = 20
eval_iters = 4
sample_interval = 40
sample_tokens = 32
log_interval = 10
checkpoint_interval = 0
