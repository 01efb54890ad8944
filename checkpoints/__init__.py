"""Sharded checkpoints with a commit protocol. Pure Python (the control plane must not
load torch); the torch part is `elastrain.checkpoints.dcp`, imported only by workers.
"""
