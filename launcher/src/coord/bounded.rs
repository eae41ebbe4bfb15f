//! etcd requests under a deadline, their errors naming the endpoints, the
//! request and the key: the one way `coord` talks to etcd once connected
//! (connecting is `super::connect`).

use std::sync::Arc;
use std::time::Duration;

use super::CoordError;

/// Runs one etcd request `op` about `key` within `limit`.
pub(crate) async fn call<T>(
    endpoints: &str,
    limit: Duration,
    op: &'static str,
    key: &str,
    fut: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, CoordError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(CoordError::Etcd {
            endpoints: endpoints.to_owned(),
            op,
            key: key.to_owned(),
            source: Arc::new(e),
        }),
        Err(_) => Err(CoordError::Timeout {
            endpoints: endpoints.to_owned(),
            op,
            key: key.to_owned(),
            after: limit,
        }),
    }
}
