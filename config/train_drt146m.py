# The paper's 146M DRT x1 on PG19 (§4.1.2, Appendix A): 6 lower layers, one retrieval group of 6 upper
# layers, a 2-layer chunk encoder; 524,160 tokens per step (the paper: 8 GPUs x 4 x 16,380),
# 60K steps = 31B tokens; AdamW (0.9, 0.95), lr 2e-3 -> 4e-4 cosine after 2% warmup, bf16.
#   torchrun --standalone --nproc_per_node=8 train.py config/train_drt146m.py   # 8 GPUs, no accumulation
#   python train.py config/train_drt146m.py                                     # 1 GPU, 8 accumulation steps
# If 4 x 16,380 does not fit a GPU, add --batch_size=2: accumulation doubles, the step stays the same.
# The model keys are DRTConfig's defaults (model.py), the optimizer keys train.py's; the run's shape is written out here.
out_dir = "out-drt146m"
dataset = "pg19"
batch_size = 4
block_size = 16380  # 260 chunks of 63 tokens
tokens_per_step = 524160  # 8 x 4 x 16380
max_iters = 60000
groups = (6,)
