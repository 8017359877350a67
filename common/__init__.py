"""Small pieces shared by the stages: the one torch.distributed wrapper, atomic file writes,
user-facing errors, logging setup, seeding and VAE loading. Nothing here knows about DiT math
(that is `dit/`) or the shard format (that is `shards/`)."""
