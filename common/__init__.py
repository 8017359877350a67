"""Small pieces shared by the stages: the torch.distributed wrappers (distributed, sharding), atomic file writes,
user-facing errors, logging setup, seeding and VAE loading. Nothing here knows about DiT math
(that is `dit/`) or the shard format (that is `shards/`)."""
