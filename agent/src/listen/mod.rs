//! What every listener of the agent holds its connections to, whatever it
//! serves: the quotas per uid or source address and the one budget of file
//! descriptors they share, with rate-limited accept errors ([`admission`]),
//! and the watch that closes a connection that is silent past its preface
//! or idle timeout and counts its open requests ([`conn_watch`]). The API's
//! listeners (`api/`), the peer TLS accept path (`tls::accept`) and the
//! daemon's set-up all use it; it imports neither of them.

pub mod admission;
pub mod conn_watch;
