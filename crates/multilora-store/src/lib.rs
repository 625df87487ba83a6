//! The tiered LoRA adapter store of multilora: source (directory or hub) → CPU cache → device slots.
//!
//! - A **registry** maps adapter names to ids, sources and what loading learned (fingerprint,
//!   rank, target modules). Registration reads no file; loading is lazy, except for the adapters
//!   the operator names at start, which are loaded before the store is returned.
//! - The **CPU tier** is an LRU of validated adapters, capacity `max_cpu_loras`, keyed by
//!   generation ([`AdapterGen`]: id + content fingerprint).
//! - The **device tier** is `max_loras` slots: [`Store::activate`] writes an adapter through the
//!   model's [`SlotSink`](multilora_adapter::SlotSink) into a free slot or the least recently used
//!   slot that no running request pins: a running request holds a [`SlotLease`]
//!   ([`Store::lease`]), and dropping it is the only way a pin is returned. A preempted request
//!   holds a [`HostLease`] ([`Store::host_lease`]) instead: its CPU entry stays, its slot may go.
//! - **Loads never run on the engine's thread**: [`Store::request`] answers at once (Ready /
//!   Loading / Failed) and a loader thread does the reading; the finished loads go to the sink
//!   given to [`StoreBuilder::events`], or else to [`Store::poll_completed`]. A load that finds
//!   every CPU entry pinned waits (still `Loading`) until one unpins; a failed load is answered
//!   from memory for a back-off ([`StoreConfig::load_retry_backoff`]), then loaded again.
//! - **Nothing unservable becomes current**: an adapter that fails validation, or targets modules
//!   without slot buffers ([`Error::UntargetedModules`]), is refused before it is registered or
//!   swapped in, so a failed `reload_in_place` leaves the old generation serving.
//! - **Lifecycle** at run time ([`Store::load`], [`Store::unload`], [`Store::reload_in_place`],
//!   resolvers) is off unless enabled and confined to configured roots.
//!
//! ```no_run
//! use multilora_adapter::{AdapterSource, ModelShapes};
//! use multilora_store::{AdapterStatus, LoraLimits, Store, StoreConfig};
//! # fn main() -> multilora_store::Result<()> {
//! let shapes = ModelShapes::llama(4, 128, 352, 512, 4, 2);
//! let config = StoreConfig::new("tiny-llama", shapes).lora(LoraLimits::slots(4)).max_cpu_loras(64);
//! let store = Store::builder(config).startup("sql", AdapterSource::Local("adapters/sql".into())).build()?;
//! if let AdapterStatus::Ready(generation) = store.request("sql")? {
//!     let lease = store.lease(generation)?; // while the request runs
//!     drop(lease); // it finished: the pin is returned
//! }
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod backoff;
mod config;
mod cpu_tier;
mod error;
mod host_lease;
mod lease;
mod lifecycle;
mod loader;
mod metrics;
mod registry;
mod resolver;
mod security;
mod slots;
mod status;
mod store;
#[cfg(test)]
mod testutil;
mod waiting;

pub use config::StoreConfig;
pub use error::{Error, Result};
pub use host_lease::HostLease;
pub use lease::SlotLease;
pub use loader::{AdapterLoader, FsLoader};
pub use metrics::{Histogram, LOAD_TIME_BUCKETS_S, StoreMetrics, TierMetrics};
pub use multilora_types::{AdapterGen, AdapterId, LoraLimits, SlotId};
pub use registry::{AdapterInfo, MAX_NAME_LEN, validate_name};
pub use resolver::{DirectoryResolver, HubResolver, Resolver};
pub use status::{AdapterStatus, LoadEvent, Unloaded};
pub use store::{Store, StoreBuilder};
