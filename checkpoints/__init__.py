"""Sharded checkpoints with a commit protocol.

Every module here is pure Python (the control plane uses them and must not load torch),
the commit protocol (`elastrain.checkpoints.commit`) included; import each from its own
module (`catalog`, `manifest`, `retention`, ...). The torch part, DCP's save and load
(`ShardedCheckpointer`) and its storage writer, lives in the `elastrain.checkpoints.dcp`
package and is imported only by workers.
"""
