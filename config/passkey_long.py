# Stage 2 of the passkey recipe, applied on top of config/passkey.py: fine-tune its 8-chunk model
# on prompts 4x as long (32 chunks of 63), so the retriever learns to pick the key's chunk among
# many, not among a few. A length curriculum: trained on 32+ chunks from scratch, the retriever
# never finds the key often enough to learn from it (README, Results).
#   python train.py config/passkey.py
#   python train.py config/passkey.py config/passkey_long.py
#   python sample.py --out_dir=out-passkey-long --passkey --lengths=2K,16K,128K,1M,4M,16M --offload
init_from = "out-passkey"  # stage 1's weights (and architecture); a fresh optimizer and schedule
out_dir = "out-passkey-long"
block_size = 2016
batch_size = 32  # the same 64.5K tokens per step
learning_rate = 1e-3
min_lr = 1e-4
max_iters = 1500
