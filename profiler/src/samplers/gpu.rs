//! GPU telemetry through NVML (placeholder until the NVML sampler lands).

/// Tables this sampler owns (a migration; see `store::MIGRATIONS`).
pub const SCHEMA: &str = "";
