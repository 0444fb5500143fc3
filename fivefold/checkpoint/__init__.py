"""Checkpoint storage: atomic files and their manifest (files.py), the tensors each rank writes and reads
through torch.distributed.checkpoint (pieces.py), checkpoints as directories of a run (store.py), and
which kind of model directory a path is (kinds.py)."""
