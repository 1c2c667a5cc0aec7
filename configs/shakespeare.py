# GPT-2 124M from scratch on tiny shakespeare, one GPU: the setting for comparing attention
# backends on real training (minutes on an H100/H200).
#   python -m data.shakespeare && python train.py configs/shakespeare.py --attn=triton
# The corpus is only ~300k tokens (~19 steps per epoch), so a 124M model soon memorises it: expect
# the val loss to turn up after a few epochs. The point here is speed and matching loss curves.
data_dir = "data/shakespeare"

model = "gpt2"
block_size = 1024
attn = "sdpa"

batch_size = 16  # 16,384 tokens per step, no gradient accumulation
max_steps = 300
learning_rate = 6e-4
min_lr = 6e-5
warmup_steps = 30

eval_interval = 50
eval_iters = 2  # the val split holds ~34k tokens: 2 batches of 16 x 1024 cover it
sample_interval = 100
sample_prompt = "ROMEO:"
log_interval = 1  # every step's time and loss go to metrics.jsonl for the backend comparison
checkpoint_interval = 0  # only at the end (and on SIGINT/SIGTERM)

compile = True
