//! The tiered LoRA adapter store of multilora: source (directory or hub) → CPU cache → device slots.
//!
//! - A **registry** maps adapter names to ids, sources and what loading learned (fingerprint,
//!   rank, target modules). Registration reads no file; loading is lazy, except for the adapters
//!   the operator names at start, which are loaded before the store is returned.
//! - The **CPU tier** is an LRU of validated adapters, capacity `max_cpu_loras`, keyed by
//!   generation ([`AdapterGen`]: id + content fingerprint).
//! - The **device tier** is `max_loras` slots: [`Store::activate`] writes an adapter through the
//!   model's [`SlotSink`](multilora_adapter::SlotSink) into a free slot or the least recently used
//!   slot that no running request pins: a running request holds a [`SlotLease`], and dropping it
//!   is the only way a pin is returned. A waiting or preempted request holds a [`HostLease`]
//!   instead ([`Store::admit`], [`SlotLease::preempt`]): its CPU entry stays, its slot may go.
//! - **Loads never run on the engine's thread**: [`Store::resolve`], the one place a name is
//!   resolved, answers at once: [`Resolution::Ready`] with an [`AdapterRef`] (the generation and
//!   its weights, kept alive by the reference), [`Resolution::Loading`] with a [`LoadTicket`] on
//!   the load it started or joined (a loader thread does the reading), or `Failed`. A request
//!   holds what it got from then on, so an unload or reload after it was accepted never fails
//!   it: a ticket ends with the generation its load read, even if that load is superseded
//!   meanwhile. [`Store::admit`] turns the reference into a host lease, putting the generation
//!   back from the weights it holds if it left. Finished loads go to the sink given to
//!   [`StoreBuilder::events`], or else to [`Store::poll_completed`]. A load that finds every CPU
//!   entry pinned waits (still `Loading`) until one unpins, a runtime [`Store::load`] or
//!   [`Store::reload_in_place`] included ([`Loaded::WaitingForRoom`]); a failed load is
//!   answered from memory for a back-off ([`StoreConfig::load_retry_backoff`]), then loaded
//!   again.
//! - **Nothing unservable becomes current**: an adapter that fails validation, or targets modules
//!   without slot buffers ([`Error::UntargetedModules`]), is refused before it is registered or
//!   swapped in, so a failed `reload_in_place` leaves the old generation serving.
//! - **Lifecycle** at run time ([`Store::load`], [`Store::unload`], [`Store::reload_in_place`],
//!   resolvers) is off unless enabled and confined to configured roots
//!   ([`Store::runtime_source`] reads a client's source string without probing outside them).
//!
//! ```no_run
//! use multilora_adapter::ModelShapes;
//! use multilora_types::AdapterSource;
//! use multilora_store::{Resolution, Store, StoreConfig};
//! use multilora_types::LoraLimits;
//! # fn main() -> multilora_store::Result<()> {
//! let shapes = ModelShapes::llama(4, 128, 352, 512, 4, 2);
//! let config = StoreConfig::new("tiny-llama", shapes).lora(LoraLimits::slots(4)).max_cpu_loras(64);
//! let store = Store::builder(config).startup("sql", AdapterSource::Local("adapters/sql".into())).build()?;
//! if let Resolution::Ready(sql) = store.resolve("sql")? {
//!     let waiting = store.admit(&sql); // the request waits in the scheduler
//!     let lease = waiting.run(); // it runs: its slot is pinned too
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
mod ticket;
mod waiting;

pub use config::StoreConfig;
pub use error::{Error, Result};
pub use host_lease::HostLease;
pub use lease::SlotLease;
pub use loader::{AdapterLoader, FsLoader};
pub use metrics::{LOAD_TIME_BUCKETS_S, StoreMetrics, TierMetrics};
pub use registry::{AdapterInfo, MAX_NAME_LEN, validate_name};
pub use resolver::{DirectoryResolver, HubResolver, MAX_OFFERED};
pub use status::{LoadEvent, Loaded, Resolution, Unloaded};
pub use store::{Store, StoreBuilder};
pub use ticket::{AdapterRef, LoadTicket};
