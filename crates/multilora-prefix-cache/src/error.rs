//! The crate's error type and `Result` alias.

use crate::{BlockId, RequestId};

/// Errors of the block pool and the KV manager.
///
/// Every failing operation leaves the pool and the manager exactly as they were.
#[non_exhaustive]
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum Error {
    /// Not enough allocatable blocks (free ones plus evictable cached ones) for the request.
    #[error("need {needed} kv blocks but only {free} are free")]
    NoFreeBlocks {
        /// Blocks that were asked for.
        needed: usize,
        /// Blocks that could have been allocated.
        free: usize,
    },
    /// The request id is not held by the manager.
    #[error("unknown request {0}")]
    UnknownRequest(RequestId),
    /// The request id is already held by the manager.
    #[error("request {0} is already admitted")]
    AlreadyAdmitted(RequestId),
    /// A block id outside `0..num_blocks`.
    #[error("unknown kv block {block} (the pool has {num_blocks} blocks)")]
    UnknownBlock {
        /// The offending block id.
        block: BlockId,
        /// Number of blocks in the pool.
        num_blocks: usize,
    },
    /// Freeing a block whose reference count is already zero.
    #[error("kv block {0} is not referenced, cannot free it")]
    BlockNotHeld(BlockId),
    /// `commit` was told more tokens are computed than the request has tokens or blocks for.
    #[error(
        "request {id}: {num_computed} computed tokens exceed its {num_tokens} tokens or its room for {capacity} tokens"
    )]
    ComputedOutOfRange {
        /// The request.
        id: RequestId,
        /// Computed tokens claimed.
        num_computed: usize,
        /// Tokens passed to `commit`.
        num_tokens: usize,
        /// Tokens that fit in the request's blocks.
        capacity: usize,
    },
    /// A configuration that cannot work.
    #[error("invalid kv config: {0}")]
    InvalidConfig(&'static str),
}

impl Error {
    /// A stable snake_case label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::NoFreeBlocks { .. } => "no_free_blocks",
            Error::UnknownRequest(_) => "unknown_request",
            Error::AlreadyAdmitted(_) => "already_admitted",
            Error::UnknownBlock { .. } => "unknown_block",
            Error::BlockNotHeld(_) => "block_not_held",
            Error::ComputedOutOfRange { .. } => "computed_out_of_range",
            Error::InvalidConfig(_) => "invalid_config",
        }
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_and_kinds() {
        let e = Error::NoFreeBlocks { needed: 3, free: 1 };
        assert_eq!(e.to_string(), "need 3 kv blocks but only 1 are free");
        assert_eq!(e.kind(), "no_free_blocks");
        assert_eq!(Error::UnknownRequest(7).to_string(), "unknown request 7");
        assert_eq!(Error::AlreadyAdmitted(7).kind(), "already_admitted");
    }
}
