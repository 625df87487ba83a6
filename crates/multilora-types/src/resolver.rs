//! [`Resolver`]: the one trait a resolver of adapter names nobody registered implements (vLLM's
//! `LoRAResolver`), and [`ResolveError`], its one error. The store asks resolvers on its loader
//! threads and implements the built-in ones (a directory, a hub allow-list); embedders write their
//! own against the same trait, through the engine's re-export.

use std::fmt;

use crate::AdapterSource;

/// Maps an adapter name nobody registered to where its files are. Synchronous: it runs on one of
/// the store's loader threads, never on the engine's, and what it answers is confined to the
/// allowed roots like any runtime source.
pub trait Resolver: Send + Sync {
    /// `Ok(None)`: this resolver does not provide `name` (the next one is asked). An error fails
    /// the requests for `name` with it.
    fn resolve(&self, name: &str) -> Result<Option<AdapterSource>, ResolveError>;

    /// The names this resolver answers for and their sources, as far as it can tell without
    /// loading anything: what the engine lists as discoverable adapters, so that a router that
    /// reads a server's model list sends it adapters nobody requested yet. A resolver over an
    /// open-ended space of names (a lookup service) offers none up front, which is what this
    /// default says.
    fn offered(&self) -> Result<Vec<(String, AdapterSource)>, ResolveError> {
        Ok(Vec::new())
    }
}

/// Why a resolver could not answer: any error, held as it is. Transparent: its message and its
/// source are those of the error it holds. The store takes its own errors back out of it
/// ([`ResolveError::downcast`]), so a built-in resolver's refusal keeps its kind; any other
/// error fails the request as the resolver's (`cause_kind` `resolver`).
#[derive(Debug)]
pub struct ResolveError(Box<dyn std::error::Error + Send + Sync>);

impl ResolveError {
    /// A resolver's failure: any error, or a message.
    pub fn new(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> ResolveError {
        ResolveError(error.into())
    }

    /// The error held, when it is an `E`; else this error back.
    pub fn downcast<E: std::error::Error + 'static>(self) -> Result<E, ResolveError> {
        match self.0.downcast::<E>() {
            Ok(e) => Ok(*e),
            Err(other) => Err(ResolveError(other)),
        }
    }

    /// The error held.
    pub fn into_inner(self) -> Box<dyn std::error::Error + Send + Sync> {
        self.0
    }
}

impl fmt::Display for ResolveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ResolveError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Mine;

    impl fmt::Display for Mine {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("mine")
        }
    }

    impl std::error::Error for Mine {}

    #[test]
    fn is_transparent_and_gives_its_error_back() {
        let e = ResolveError::new("registry unreachable");
        assert_eq!(e.to_string(), "registry unreachable");
        let e = e.downcast::<Mine>().unwrap_err();
        assert_eq!(e.into_inner().to_string(), "registry unreachable");
        assert!(matches!(ResolveError::new(Mine).downcast::<Mine>(), Ok(Mine)));
    }
}
