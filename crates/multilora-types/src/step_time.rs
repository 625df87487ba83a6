//! `StepTime`: how long a step that carries decode rows may take, the knob the engine is built
//! with and the scheduler applies (with the step cost the engine measures, in
//! `multilora_scheduler::StepCost`).

/// How long a step that carries decode rows may take. A step with no decode row stalls no stream,
/// so it is bounded by the token budget (`max_num_batched_tokens`) alone.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum StepTime {
    /// No time budget: prefill takes whatever `max_num_batched_tokens` leaves (vLLM's behaviour
    /// with a fixed token budget).
    #[default]
    Unbounded,
    /// At most `factor` times the modelled time of the step's decode rows alone, so the largest
    /// gap between a stream's tokens stays within about `factor` times the usual one, whatever
    /// the device.
    Auto {
        /// The multiple of a decode-only step (> 1).
        factor: f64,
    },
    /// At most this many seconds.
    Max {
        /// Seconds.
        seconds: f64,
    },
}

/// [`StepTime::Auto`]'s default factor: a step may take 2.5 decode steps, which keeps the largest
/// inter-token gap within 3× the median with room for the cost model's error.
pub const DEFAULT_STEP_FACTOR: f64 = 2.5;

impl StepTime {
    /// A stable name: `unbounded`, `auto` or `max`.
    pub fn name(&self) -> &'static str {
        match self {
            StepTime::Unbounded => "unbounded",
            StepTime::Auto { .. } => "auto",
            StepTime::Max { .. } => "max",
        }
    }
}
