//! What a joined thread's panic said: the store's writer and the samplers
//! turn a panic on their thread into an error that names it.

/// The message a thread's panic was raised with (the writer's, a sampler's).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}
