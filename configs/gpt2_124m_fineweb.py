# GPT-2 124M on 10B tokens of FineWeb-Edu: the build-nanogpt recipe, ~0.5M tokens per step.
#   python -m data.fineweb && torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_124m_fineweb.py
# Gradient accumulation makes up the rest of each step's 524,288 tokens: 1 micro-step per rank on
# 8 GPUs, 8 on one GPU (same curve, 8x the time).
data_dir = "data/fineweb_edu"

model = "gpt2"
block_size = 1024
vocab_size = 50304

batch_size = 64
total_batch_size = 524_288  # 2**19 tokens
max_steps = 19_073  # one pass over ~10B tokens: 10e9 / 524,288
learning_rate = 6e-4
min_lr = 6e-5  # 10% of the peak
warmup_steps = 715
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 250
eval_iters = 20
sample_interval = 1000
sample_prompt = "Hello, I'm a language model,"
log_interval = 10
checkpoint_interval = 2000

compile = True
