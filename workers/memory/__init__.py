"""Training state kept in worker processes' host memory across attempts (live replicas,
shard snapshots with a buddy's copy on another node), re-sharded with DCP's planner.
"""
