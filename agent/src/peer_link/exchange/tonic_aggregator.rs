//! The exchange's [`AggregatorLink`] and [`AggregatorDial`] over
//! `warden.v1.Peer`: a host's report encoded ([`super::wire`]), sent with
//! [`super::call`], and the answer decoded and checked.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};
use warden_core::detect::positions::JobPositions;
use warden_core::detect::sdc::aggregate::JobValues;
use warden_core::detect::straggler::aggregate::HostReport;
use warden_proto::v1::peer_client::PeerClient;

use super::call::call;
use super::wire::{answer_from_pb, report_pb};
use crate::ckpt::Peer;
use crate::exchange::aggregate::Here;
use crate::exchange::link::{AggregatorDial, AggregatorLink, CallFailed};
use crate::tls::PeerTls;
use crate::tls::connect::{PeerConnector, SeenNames};

/// One host over tonic.
#[derive(Debug, Clone)]
pub struct TonicAggregator {
    /// Its client (a job's peer's, shared with the checkpoint flow, or one
    /// dialed by address).
    pub client: PeerClient<Channel>,
}

/// The client of a host's `link`, when it is one of ours: a leader's relay
/// passes a member's report on as it came, without decoding it again.
pub fn client_of(link: &dyn AggregatorLink) -> Option<PeerClient<Channel>> {
    link.as_any()
        .downcast_ref::<TonicAggregator>()
        .map(|a| a.client.clone())
}

#[async_trait::async_trait]
impl AggregatorLink for TonicAggregator {
    async fn report(
        &self,
        report: &HostReport,
        positions: &[JobPositions],
        values: &[JobValues],
        limit: Duration,
    ) -> Result<Here, CallFailed> {
        let wire = report_pb(report, positions, values);
        let answer = call(&mut self.client.clone(), wire, limit)
            .await
            .map_err(|e| e.to_call())?;
        answer_from_pb(answer).map_err(CallFailed::BadAnswer)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// Dials hosts for the exchange: through a job's checkpoint peer, or by
/// address through the agents' TLS, remembering the names their
/// certificates carry.
#[derive(Debug)]
pub struct TonicAggregatorDial {
    /// The agents' mutual TLS (or none).
    pub peer_tls: PeerTls,
    /// The certificate names of the hosts dialed by address.
    pub seen: Arc<SeenNames>,
    /// `straggler.peer_timeout`.
    pub peer_timeout: Duration,
}

impl AggregatorDial for TonicAggregatorDial {
    fn through(&self, peer: &Peer) -> Option<Arc<dyn AggregatorLink>> {
        crate::peer_link::ckpt::tonic_peer::client_of(&*peer.link)
            .map(|client| Arc::new(TonicAggregator { client }) as Arc<dyn AggregatorLink>)
    }

    fn by_addr(&self, addr: &str) -> Option<Arc<dyn AggregatorLink>> {
        let limit = self.peer_timeout;
        Endpoint::from_shared(format!("http://{addr}"))
            .map(|e| {
                Arc::new(TonicAggregator {
                    client: PeerClient::new(
                        e.connect_timeout(limit)
                            .timeout(limit * 2)
                            .connect_with_connector_lazy(
                                PeerConnector::new(self.peer_tls.clone(), "")
                                    .recording(self.seen.clone()),
                            ),
                    ),
                }) as Arc<dyn AggregatorLink>
            })
            .map_err(|e| tracing::warn!(peer = %addr, error = %e, "unusable aggregator address"))
            .ok()
    }
}
