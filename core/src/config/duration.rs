//! Durations in the config are written as people write them: "100ms", "5s", "2m".

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// Writes a duration the way it is read back ("1s 500ms").
pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

/// Reads "100ms", "5s", "1m 30s"; the error says what form is expected.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    humantime::parse_duration(&s).map_err(|e| {
        serde::de::Error::custom(format!(
            "invalid duration {s:?} ({e}); write it like \"100ms\", \"5s\" or \"2m\""
        ))
    })
}

/// A table of named durations (`[hang.timeouts]`).
pub mod map {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer, ser::SerializeMap};

    /// Writes each duration as text.
    pub fn serialize<S: Serializer>(
        m: &BTreeMap<String, Duration>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        let mut out = s.serialize_map(Some(m.len()))?;
        for (k, v) in m {
            out.serialize_entry(k, &humantime::format_duration(*v).to_string())?;
        }
        out.end()
    }

    /// Reads a table of `name = "duration"`.
    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, Duration>, D::Error> {
        let raw = BTreeMap::<String, String>::deserialize(d)?;
        raw.into_iter()
            .map(|(k, v)| {
                humantime::parse_duration(&v)
                    .map(|d| (k.clone(), d))
                    .map_err(|e| {
                        serde::de::Error::custom(format!(
                            "{k}: invalid duration {v:?} ({e}); write it like \"30s\" or \"5m\""
                        ))
                    })
            })
            .collect()
    }
}
