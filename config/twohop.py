# Stage 2 with 2-hop variable tracking (RULER) beside passkey and multi-key, for DRT x2: read after
# config/passkey_finetune.py, whose settings it keeps, from a stage 1 with two retrieval groups.
#   python train.py config/passkey_pretrain.py --groups="(1,1)" --out_dir=out-pre2
#   python train.py config/passkey_finetune.py config/twohop.py
#   python sample.py --out_dir=out-twohop --vartrack --passkey --multikey --lengths=4K,64K,1M --haystack=data/pg19/test.bin
# Half the rows ask "What is the value of VAR Y?" among 2-8 chains "VAR X = 12345." ... "VAR Y = X." (tasks.py), laid
# out as a test lays them (tasks.hop_spacing): "VAR Y = X." 384 tokens before the end, beyond what the windows carry
# to the answer, and 384 after "VAR X = 12345.", so that no chunk's memory holds both; every chain alike, so that only
# the names tell the asked chain (placed alone, it stood apart, and models found both hops by where they stood:
# dev/LOG.md). That takes rows of 1,512 tokens (24 chunks); in rows of 1,008 the hops lie 2 chunks apart and the
# memory of hop 1's chunk can hold the number (one retrieval may answer there, never in a test). From one stage 1 and
# seed, 1,008-token rows with the asked chain standing apart scored 30/15/15% at 4K/64K/1M, these rows 90/95/100%
# (dev/LOG.md; 1,008-token rows with every chain alike are not yet run). The batch keeps stage 2's ~64K tokens a step.
# The question closes a chunk a chunk ahead of the answer's: at its landmark group 1 fetches "VAR Y = X."; the next
# chunk reads it, so group 2's query at the landmark serving the answer knows X and can fetch "VAR X = 12345."
# (model.py's DRT.run; the paper's layout, with the question in the last chunk alone, leaves group 2 no chunk to read
# group 1's find in). The needle ranking loss names each hop in its group, at its landmark, and a one-hop row's needle
# in group 1 alone (tasks.needle_labels); the teacher's chunks are those of config/passkey_finetune.py, which for
# these rows are the two hops at their two landmarks, each handed to its own group (teacher.per_hop).
# Three fresh seeds of three pass the 2-hop tests (the README's 2-hop table); earlier seeds trained on 1,008-token rows.
out_dir = "out-twohop"
init_from = "out-pre2"
dataset = "passkey,multikey,vartrack,vartrack"  # half the rows 2-hop
task_chains = "2-8"  # 4-16 needles a prompt; the tests ask among 6 chains
teacher_hops = True  # while the teacher hands chunks, hop 2's goes to group 2 alone: the answer comes through it
block_size = 1512  # room for the test's layout after task_min_depth: each hop told among ~3.8 chunks of its kind
batch_size = 42  # 63,504 tokens a step, as stage 2's 64 x 1,008
