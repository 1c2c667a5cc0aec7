# Dense vs sliding-window vs MoBA attention on real training: GPT-2 124M on tiny shakespeare at
# T=1024, one GPU, same seed and data order for each; the Triton kernels run all three, so the
# attention pattern is the only difference (issue 5's training comparison).
#   python -m data.shakespeare
#   python -m benchmarks.compare --variants dense:attn=triton window:attn=triton,window=256 \
#       moba:attn=moba,moba_block=128,moba_topk=3 -- configs/shakespeare_sparse.py
# or one run: python train.py configs/shakespeare_sparse.py --window=256
data_dir = "data/shakespeare"

model = "gpt2"
block_size = 1024
attn = "triton"  # runs the window block-sparse: only the key blocks inside it are read
window = 0  # dense causal; the window run passes --window=256 (each token sees the 256 before it)
# --attn=moba: MoBA's paper uses blocks of 512, but at T=1024 that is 2 blocks, and a query in the
# second has 1 earlier block, which top-3 always picks: MoBA would be dense causal. Blocks of 128
# make 8, and a query reads at most its own + 3 others: 512 of the 1024 keys.
moba_block = 128
moba_topk = 3

batch_size = 16  # 16,384 tokens per step, as configs/shakespeare.py
max_steps = 300
learning_rate = 6e-4
min_lr = 6e-5
warmup_steps = 30
seed = 1337

eval_interval = 50
eval_iters = 2  # the val split holds ~34k tokens: 2 batches of 16 x 1024 cover it
sample_interval = 0  # samples do not enter the comparison, and MoBA samples without a KV cache (slow)
log_interval = 1  # every step's time and loss go to metrics.jsonl for the comparison
checkpoint_interval = 0  # only at the end (and on SIGINT/SIGTERM)

compile = True
