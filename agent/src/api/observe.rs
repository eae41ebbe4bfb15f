//! Counts and times every API call by method and gRPC status code, and
//! shows the calls under way.

use std::future::Future;
use std::time::Instant;

use tonic::Status;

/// Runs a handler and records `warden_api_requests_total{method,code}`,
/// `warden_api_request_duration_seconds{method}` and, until its answer
/// starts, `warden_api_requests_in_flight{method}`: a call that hangs shows
/// there before it ends (a restore wave waiting on a silent peer, a listing
/// blocked on a tier), where the total counts it only once it is done. A
/// streamed answer's transfer (FetchShard's chunks, a Watch stream) is not
/// counted: the handler has returned by then.
pub async fn observed<T>(
    method: &'static str,
    handler: impl Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    let start = Instant::now();
    let _in_flight = InFlight::enter(method);
    let result = handler.await;
    let code = match &result {
        Ok(_) => "OK".to_owned(),
        Err(s) => format!("{:?}", s.code()),
    };
    metrics::counter!("warden_api_requests_total", "method" => method, "code" => code).increment(1);
    metrics::histogram!("warden_api_request_duration_seconds", "method" => method)
        .record(start.elapsed().as_secs_f64());
    result
}

/// One call counted in `warden_api_requests_in_flight` until dropped: also
/// when the caller goes away and the handler is dropped mid-way.
struct InFlight(&'static str);

impl InFlight {
    fn enter(method: &'static str) -> Self {
        metrics::gauge!("warden_api_requests_in_flight", "method" => method).increment(1.0);
        Self(method)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        metrics::gauge!("warden_api_requests_in_flight", "method" => self.0).decrement(1.0);
    }
}
