"""Building blocks of the `spmd-partition` pass: input layouts from the plan (`layouts`),
per-op sharding rules (`rules`) and the collectives that change a sharding (`redistribute`)."""
