//! `[simulated]`: a scripted node played next to the real sources (the
//! section `wardend --simulate` and `--simulate-speed` fill in). Kept apart
//! from the source so that the sources' settings (`super::super::settings`)
//! name it without importing the source.

use serde::{Deserialize, Serialize};
use warden_core::config::ConfigError;

use super::SimScenario;

/// The fastest a scenario may be played: scenario seconds per wall second.
pub const MAX_SPEED: f64 = 10_000.0;

/// `[simulated]`: the scenario to play, if any.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimulatedConfig {
    /// The scenario file (devices and scripted faults); empty, the default:
    /// no simulated node.
    pub scenario: String,
    /// Scenario seconds per wall second; absent: the scenario's own `speed`.
    pub speed: Option<f64>,
}

impl SimulatedConfig {
    /// Checks the section's values, without reading anything: a speed in
    /// (0, 10000], only with a scenario; the scenario an absolute path.
    /// Why no read here: a launcher parses the agent's printed config as
    /// the job's user, elsewhere; `wardend` reads and checks the scenario
    /// itself before it starts ([`SimulatedConfig::load`]), and the source
    /// again when it is built.
    pub fn validate(&self, origin: &str) -> Result<(), ConfigError> {
        let invalid = ConfigError::invalid_in(origin);
        if let Some(speed) = self.speed {
            if !(speed > 0.0 && speed <= MAX_SPEED) {
                return Err(invalid(
                    "simulated.speed",
                    speed.to_string(),
                    "must be in (0, 10000]",
                ));
            }
            if self.scenario.is_empty() {
                return Err(invalid(
                    "simulated.speed",
                    speed.to_string(),
                    "plays a scenario: set simulated.scenario too",
                ));
            }
        }
        if !self.scenario.is_empty() && !std::path::Path::new(&self.scenario).is_absolute() {
            return Err(invalid(
                "simulated.scenario",
                format!("{:?}", self.scenario),
                "must be an absolute path",
            ));
        }
        Ok(())
    }

    /// The scenario, read and checked (a regular file of at most 1 MiB,
    /// every key known); None when none is set.
    pub fn load(&self) -> Result<Option<SimScenario>, super::SimScenarioError> {
        if self.scenario.is_empty() {
            return Ok(None);
        }
        SimScenario::from_file(std::path::Path::new(&self.scenario)).map(Some)
    }
}
