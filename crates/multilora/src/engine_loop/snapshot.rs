//! The metrics snapshot: the scheduler's counts, the store's tiers and load times and the
//! loop's own counters, as one `MetricsSnapshot` for `metrics()` and the exporters.

use std::collections::HashMap;

use multilora_types::AdapterGen;

use super::EngineLoop;
use crate::metrics::{MetricsSnapshot, TierOccupancy};

impl EngineLoop {
    pub(super) fn note_deferred(&mut self) {
        let now = self.deferred.len() + self.scheduler.counts().deferred;
        self.counters.deferred_max = self.counters.deferred_max.max(now);
    }

    pub(super) fn snapshot(&self) -> MetricsSnapshot {
        let c = self.scheduler.counts();
        let sm = self.store.metrics();
        let names: HashMap<_, String> = self.store.adapters().into_iter().map(|i| (i.id, i.name)).collect();
        let name = |g: &AdapterGen| names.get(&g.id).cloned().unwrap_or_else(|| format!("#{}", g.id));
        let deferred = self.deferred.len() + c.deferred;
        // Requests waiting in the engine for their adapter's load wait like the scheduler's own
        // (vLLM counts them in `num_requests_waiting` and `waiting_lora_adapters`).
        let mut waiting_adapters: Vec<String> = c.waiting_adapters.iter().map(name).collect();
        for id in &self.deferred {
            if let Some(live) = self.live.get(id)
                && !waiting_adapters.contains(&live.sub.model)
            {
                waiting_adapters.push(live.sub.model.clone());
            }
        }
        waiting_adapters.sort();
        MetricsSnapshot {
            running: c.running,
            waiting: c.waiting + self.deferred.len(),
            deferred,
            deferred_max: self.counters.deferred_max.max(deferred),
            running_adapters: c.running_adapters.iter().map(name).collect(),
            waiting_adapters,
            max_lora: self.config.lora.max_loras(),
            device_tier: TierOccupancy { entries: sm.device.entries, capacity: sm.device.capacity },
            cpu_tier: TierOccupancy { entries: sm.cpu.entries, capacity: sm.cpu.capacity },
            pinned_slots: sm.pinned_slots,
            kv_usage: c.kv.usage,
            kv_blocks: c.kv.num_blocks,
            prompt_tokens: self.counters.prompt_tokens,
            generation_tokens: self.counters.generation_tokens,
            requests_finished: self.counters.finished.clone(),
            request_errors: self.counters.errors.clone(),
            prefix_cache_queries: c.kv.queries,
            prefix_cache_query_tokens: c.kv.query_tokens,
            prefix_cache_hit_tokens: c.kv.hit_tokens,
            preemptions: self.counters.preemptions,
            adapter_loads: sm.loads,
            adapter_events_pending: sm.events_pending + self.events.pending(),
            adapter_evictions: sm.cpu.evictions + sm.device.evictions,
            adapter_loads_waiting: sm.waiting_for_capacity,
            adapter_capacity_waits: sm.capacity_waits,
            per_adapter: self.counters.per_adapter.clone(),
            ttft: self.counters.ttft.clone(),
            inter_token_latency: self.counters.itl.clone(),
            e2e_latency: self.counters.e2e.clone(),
            adapter_load_time: sm.load_time,
            steps: self.counters.steps,
            step_duration: self.counters.step_duration.clone(),
            iteration_tokens: self.counters.iteration_tokens.clone(),
            prefill_tokens_per_step: self.counters.prefill_tokens.clone(),
            step_rows: self.counters.step_rows.clone(),
            step_adapters: self.counters.step_adapters.clone(),
            grammar_mask_duration: self.counters.mask_duration.clone(),
            grammar_forced_tokens: self.counters.forced_tokens,
        }
    }
}
