//! Counts and times every API call by method and gRPC status code.

use std::future::Future;
use std::time::Instant;

use tonic::Status;

/// Runs a handler and records `warden_api_requests_total{method,code}` and
/// `warden_api_request_duration_seconds{method}`.
pub async fn observed<T>(
    method: &'static str,
    handler: impl Future<Output = Result<T, Status>>,
) -> Result<T, Status> {
    let start = Instant::now();
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
