//! The proof that a Peer request passed the frame's rule. A module of its
//! own so that the handlers of the stages (`api::ckpt`) name the type
//! without importing the service that calls them.

/// A request whose caller the Peer frame authorized for the job it names
/// (rule `job-member`, `peer_service::member`; a request that names no
/// job is one too). Only the Peer service's frame makes one (its
/// constructor is visible to `api::peer_service` alone), so a handler that
/// takes one cannot be reached around the rule.
#[derive(Debug)]
pub struct Authorized<T>(T);

impl<T> Authorized<T> {
    /// `req`, authorized: for the frame, after the rule ran.
    pub(in crate::api::peer_service) fn new(req: T) -> Self {
        Self(req)
    }

    /// The request.
    pub fn into_inner(self) -> T {
        self.0
    }
}
