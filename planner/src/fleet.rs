//! The fleet bench's results (cli/benches/coord_fleet.rs, issue 30): what a
//! restart round, a join, etcd's bytes and CPU cost at N hosts, the growth
//! exponent of each fitted on log-log, and the restart round at any host
//! count read off that fit, labelled as measured, interpolated or
//! extrapolated.
//!
//! In: the bench's JSON ([`FleetResults`]); the copy committed at
//! planner/data/fleet.json is embedded ([`embedded`]), so a plan at the
//! `llama3` preset's 2,048 hosts uses the round time measured at 2,048.
//! Out: [`Fit`]s, a [`RoundEstimate`] for a host count, the results as
//! markdown tables ([`markdown`]) and as an SVG plot ([`svg`]), the same
//! code for the bench's own print-out and for docs/benchmarks.md.
//! Never: present a figure past the measured range as measured (the basis
//! says which), or accept a results file that is not the bench's shape.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::{Deserialize, Serialize};

/// The committed results (written by the bench, read here at build time).
const EMBEDDED: &str = include_str!("../data/fleet.json");

/// A results file that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FleetError {
    /// Not the bench's JSON.
    #[error("fleet results: {0}")]
    Parse(String),
    /// Fewer than two host counts with a positive round time: no curve.
    #[error("fleet results: no curve: {0}")]
    NoCurve(String),
}

/// One run of the fleet bench: rows, one per etcd set-up and host count.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetResults {
    /// The rows, in the order they were measured.
    pub rows: Vec<FleetRow>,
}

/// What one fleet of `hosts` hosts measured. Times in seconds, sizes in
/// bytes; "per round" is the mean over the bench's restart rounds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetRow {
    /// The commit measured (`git rev-parse --short HEAD` at the run).
    pub commit: String,
    /// Hosts in the job.
    pub hosts: u64,
    /// Of them, hosts running the real coordinator.
    pub full: u64,
    /// etcd members (1: a single server; 3: a cluster on 127.0.0.2-4).
    pub etcd_members: u32,
    /// The lease TTL.
    pub ttl_s: f64,
    /// The machine's 1-minute load average when the row was done.
    pub load: f64,
    /// From the first join to every host holding the first round.
    pub join_s: f64,
    /// Restart round (`request_restart` to every host holding it), median.
    pub round_median_s: f64,
    /// ... its 90th percentile.
    pub round_p90_s: f64,
    /// A host lost without a word to every other host holding the round
    /// without it (TTL, etcd's expiry sweep, the rejoin grace).
    pub lost_s: f64,
    /// A new host joining in its place, to every host holding that round.
    pub replaced_s: f64,
    /// A spare swap: a host lost without a word while a spare stands by,
    /// to every host holding the round with the spare in it.
    pub swap_lost_s: f64,
    /// A spare swap after a cordon (`leave`), to every host holding the
    /// round with the spare in it.
    pub swap_cordon_s: f64,
    /// Bytes etcd sent to clients per restart round (all members).
    pub etcd_sent_per_round: f64,
    /// Bytes etcd received per restart round.
    pub etcd_received_per_round: f64,
    /// etcd's CPU per restart round, seconds (all members).
    pub etcd_cpu_per_round_s: f64,
    /// Of it, what etcd spends with no round at all over as long as a
    /// round lasts (every host's keep-alives, etcd's timers): measured
    /// right after the rounds; 0 in rows measured before it was.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub etcd_idle_cpu_per_round_s: f64,
    /// The fleet process's CPU per restart round (full and light hosts).
    pub fleet_cpu_per_round_s: f64,
    /// What a host reads for a round: the round record.
    pub round_record_bytes: u64,
    /// Memory per light host ([`FleetRow::memory`] says which).
    pub rss_per_light: u64,
    /// Memory per full host at this fleet's size (a host that does not
    /// decide rounds; [`FleetRow::memory`] says which).
    pub rss_per_full: u64,
    /// What the memory per host counts: `"heap"`, the live heap bytes of
    /// the bench's counting allocator, or `"rss"` (empty in rows measured
    /// before the allocator), the process's resident memory, which moves
    /// by allocator arenas and is only a rough figure.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub memory: String,
    /// etcd's resident memory at the end of the rounds (all members).
    pub etcd_rss: u64,
    /// Restart rounds while the etcd leader is SIGKILLed (a cluster only).
    pub leader_kill: Option<FaultRounds>,
    /// Restart rounds while an etcd follower is SIGSTOPped past the lease
    /// TTL (a cluster only).
    pub member_pause: Option<FaultRounds>,
    /// etcd gRPC proxies between the hosts and the members (0: the hosts
    /// reach the members). A row with proxies is a set-up of its own: the
    /// fits, the plot and the planner leave it out.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub proxies: u32,
    /// The proxies' CPU per restart round, seconds (all of them).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub proxy_cpu_per_round_s: f64,
    /// The proxies' resident memory after the rounds, bytes (all of them).
    #[serde(default, skip_serializing_if = "is_zero_u64")]
    pub proxy_rss: u64,
    /// The etcd server's version (`etcd --version`); empty in rows measured
    /// before it was recorded, all on Debian's etcd 3.4 (the tests' etcd).
    /// A row on another version is a set-up of its own, as a row through
    /// proxies: the fits, the plot and the planner leave it out.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub etcd_version: String,
}

/// The etcd release line the tests run on, and every row before the
/// version was recorded: Debian's etcd-server 3.4.
pub const DEFAULT_ETCD: &str = "3.4";

impl FleetRow {
    /// Whether the row was measured on the tests' etcd line
    /// ([`DEFAULT_ETCD`]) with the hosts straight on the members: the rows
    /// the fits, the plot and the planner take.
    pub fn is_default_setup(&self) -> bool {
        self.proxies == 0 && self.on_default_etcd()
    }

    /// The etcd version as a table shows it (rows from before it was
    /// recorded: the [`DEFAULT_ETCD`] line).
    pub fn version(&self) -> &str {
        if self.etcd_version.is_empty() {
            DEFAULT_ETCD
        } else {
            &self.etcd_version
        }
    }

    /// Whether the row's etcd is of the [`DEFAULT_ETCD`] line.
    pub fn on_default_etcd(&self) -> bool {
        self.etcd_version.is_empty()
            || self.etcd_version == DEFAULT_ETCD
            || self.etcd_version.starts_with(&format!("{DEFAULT_ETCD}."))
    }

    /// Whether `other` measured the same set-up at the same size: a new
    /// run replaces it in a results file. The etcd line counts, not the
    /// patch release: a row from before the version was recorded and a
    /// 3.4.23 row are the same set-up.
    pub fn same_setup(&self, other: &Self) -> bool {
        self.hosts == other.hosts
            && self.etcd_members == other.etcd_members
            && self.proxies == other.proxies
            && (self.on_default_etcd() && other.on_default_etcd()
                || self.etcd_version == other.etcd_version)
    }
}

/// No proxies (rows before them).
#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero_u32(v: &u32) -> bool {
    *v == 0
}

/// Not measured.
#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero_u64(v: &u64) -> bool {
    *v == 0
}

/// A figure not measured in an older row.
#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// Restart rounds made while an etcd member fails.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultRounds {
    /// Rounds made during the fault.
    pub rounds: u32,
    /// The round in flight when the fault began (or the first after it).
    pub hit_s: f64,
    /// The longest round during the fault.
    pub max_s: f64,
    /// The rounds' median.
    pub median_s: f64,
    /// Restart requests etcd refused or left unanswered (each asked again).
    pub refused: u32,
    /// How long the fault lasted (a pause; 0 for a kill).
    pub fault_s: f64,
    /// Hosts whose lease etcd let expire during the fault.
    pub leases_lost: u64,
    /// Every host kept its lease and its member key.
    pub leases_kept: bool,
}

/// A power law `coefficient * N^exponent`, fitted by least squares on
/// log-log.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Fit {
    /// The growth exponent: 1 is linear in N, 2 quadratic.
    pub exponent: f64,
    /// The value at N = 1.
    pub coefficient: f64,
    /// Points fitted.
    pub points: usize,
}

impl Fit {
    /// The fitted value at `n` hosts.
    pub fn at(&self, n: f64) -> f64 {
        self.coefficient * n.powf(self.exponent)
    }
}

/// Least squares of `ln y` on `ln x` over the points with both positive;
/// `None` with fewer than two distinct `x`.
pub fn fit(points: &[(f64, f64)]) -> Option<Fit> {
    let logs: Vec<(f64, f64)> = points
        .iter()
        .filter(|(x, y)| *x > 0.0 && *y > 0.0 && x.is_finite() && y.is_finite())
        .map(|(x, y)| (x.ln(), y.ln()))
        .collect();
    #[allow(clippy::cast_precision_loss)]
    let n = logs.len() as f64;
    if logs.len() < 2 {
        return None;
    }
    let mx = logs.iter().map(|p| p.0).sum::<f64>() / n;
    let my = logs.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = logs.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx <= 1e-12 {
        return None;
    }
    let sxy: f64 = logs.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let exponent = sxy / sxx;
    Some(Fit {
        exponent,
        coefficient: (my - exponent * mx).exp(),
        points: logs.len(),
    })
}

/// What a restart-round figure rests on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FigureBasis {
    /// The bench ran this host count: its median.
    Measured,
    /// Between two measured host counts: the fitted curve.
    Interpolated,
    /// Beyond the measured host counts: the fitted curve, extended.
    Extrapolated,
}

impl FigureBasis {
    /// The word for reports.
    pub fn word(self) -> &'static str {
        match self {
            FigureBasis::Measured => "measured",
            FigureBasis::Interpolated => "interpolated",
            FigureBasis::Extrapolated => "extrapolated",
        }
    }
}

/// The restart round at one host count, read off the fleet bench.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundEstimate {
    /// Seconds.
    pub seconds: f64,
    /// Measured, interpolated or extrapolated.
    pub basis: FigureBasis,
    /// The host count asked for.
    pub hosts: u64,
    /// The measured range the curve was fitted over.
    pub measured: (u64, u64),
    /// etcd members of the rows used.
    pub etcd_members: u32,
    /// The curve.
    pub fit: Fit,
}

impl RoundEstimate {
    /// The label in a plan's inputs line.
    pub fn label(&self) -> String {
        let (lo, hi) = self.measured;
        match self.basis {
            FigureBasis::Measured => format!(
                "measured at {} hosts, fleet bench, {}-member etcd",
                self.hosts, self.etcd_members
            ),
            b => format!(
                "{} to {} hosts on the fleet bench's fit N^{:.2} over {lo}-{hi} hosts, {}-member etcd",
                b.word(),
                self.hosts,
                self.fit.exponent,
                self.etcd_members
            ),
        }
    }
}

/// The committed results.
pub fn embedded() -> Result<FleetResults, FleetError> {
    FleetResults::parse(EMBEDDED)
}

/// The quantities fitted against N, with their units for the plot.
pub const SERIES: [(&str, &str); 4] = [
    ("restart round, median", "s"),
    ("join, all hosts", "s"),
    ("etcd bytes sent per round", "B"),
    ("etcd CPU per round", "s"),
];

impl FleetResults {
    /// Parses the bench's JSON.
    pub fn parse(text: &str) -> Result<Self, FleetError> {
        serde_json::from_str(text).map_err(|e| FleetError::Parse(e.to_string()))
    }

    /// The etcd set-ups present without proxies, in order (1 before 3).
    pub fn setups(&self) -> Vec<u32> {
        let mut m: Vec<u32> = self
            .rows
            .iter()
            .filter(|r| r.is_default_setup())
            .map(|r| r.etcd_members)
            .collect();
        m.sort_unstable();
        m.dedup();
        m
    }

    /// The rows of one etcd set-up, by host count.
    pub fn rows_of(&self, members: u32) -> Vec<&FleetRow> {
        let mut rows: Vec<&FleetRow> = self
            .rows
            .iter()
            .filter(|r| r.etcd_members == members && r.is_default_setup())
            .collect();
        rows.sort_by_key(|r| r.hosts);
        rows
    }

    /// The rows measured through etcd gRPC proxies, by etcd version,
    /// members, proxies and host count.
    pub fn proxied(&self) -> Vec<&FleetRow> {
        let mut rows: Vec<&FleetRow> = self.rows.iter().filter(|r| r.proxies > 0).collect();
        rows.sort_by(|a, b| {
            (&a.etcd_version, a.etcd_members, a.proxies, a.hosts).cmp(&(
                &b.etcd_version,
                b.etcd_members,
                b.proxies,
                b.hosts,
            ))
        });
        rows
    }

    /// The rows on an etcd of another line than [`DEFAULT_ETCD`], hosts
    /// straight on the members, grouped by (version, members), each group
    /// by host count.
    pub fn other_etcd(&self) -> Vec<((String, u32), Vec<&FleetRow>)> {
        let mut groups: BTreeMap<(String, u32), Vec<&FleetRow>> = BTreeMap::new();
        for r in self
            .rows
            .iter()
            .filter(|r| r.proxies == 0 && !r.on_default_etcd())
        {
            groups
                .entry((r.etcd_version.clone(), r.etcd_members))
                .or_default()
                .push(r);
        }
        groups
            .into_iter()
            .map(|(k, mut rows)| {
                rows.sort_by_key(|r| r.hosts);
                (k, rows)
            })
            .collect()
    }

    /// Series `i` of [`SERIES`] for one set-up, as (N, value) points.
    pub fn series(&self, members: u32, i: usize) -> Vec<(f64, f64)> {
        series_of(&self.rows_of(members), i)
    }

    /// Each series' fit for one set-up.
    pub fn fits(&self, members: u32) -> [Option<Fit>; 4] {
        fits_of(&self.rows_of(members))
    }

    /// The restart round at `hosts` hosts: on the rows of the largest etcd
    /// set-up (the 3-member cluster: what a production job runs on) whose
    /// measured host counts reach `hosts`, so a measurement on one set-up is
    /// preferred to an extrapolation on another; where none reaches it, the
    /// curve of the set-up measured farthest (the largest set-up of those),
    /// extended from there.
    ///
    /// Why: the cluster's rows stop at 2,048 hosts (this machine's
    /// descriptors), the single member's reach 12,500, and the cluster's
    /// fit extended to 12,500 hosts gave 274 ms where the single member
    /// measured 617 ms (docs/benchmarks.md, "Past 2,048 hosts").
    pub fn round_at(&self, hosts: u64) -> Result<RoundEstimate, FleetError> {
        let curves: Vec<u32> = self
            .setups()
            .into_iter()
            .rev()
            .filter(|m| self.series(*m, 0).iter().filter(|p| p.1 > 0.0).count() >= 2)
            .collect();
        let reach = |m: u32| self.rows_of(m).last().map_or(0, |r| r.hosts);
        let farthest = curves
            .iter()
            .copied()
            .fold(None, |best: Option<u32>, m| match best {
                Some(b) if reach(b) >= reach(m) => Some(b),
                _ => Some(m),
            });
        let members = curves
            .iter()
            .copied()
            .find(|&m| reach(m) >= hosts)
            .or(farthest)
            .ok_or_else(|| FleetError::NoCurve("fewer than two host counts measured".into()))?;
        let rows = self.rows_of(members);
        let points = self.series(members, 0);
        let f = fit(&points).ok_or_else(|| FleetError::NoCurve("one host count only".into()))?;
        let lo = rows.first().map_or(0, |r| r.hosts);
        let hi = rows.last().map_or(0, |r| r.hosts);
        let (seconds, basis) = match rows.iter().find(|r| r.hosts == hosts) {
            Some(r) => (r.round_median_s, FigureBasis::Measured),
            #[allow(clippy::cast_precision_loss)]
            None if (lo..=hi).contains(&hosts) => (f.at(hosts as f64), FigureBasis::Interpolated),
            #[allow(clippy::cast_precision_loss)]
            None => (f.at(hosts as f64), FigureBasis::Extrapolated),
        };
        Ok(RoundEstimate {
            seconds,
            basis,
            hosts,
            measured: (lo, hi),
            etcd_members: members,
            fit: f,
        })
    }
}

/// Series `i` of [`SERIES`] over `rows`, as (N, value) points.
fn series_of(rows: &[&FleetRow], i: usize) -> Vec<(f64, f64)> {
    rows.iter()
        .map(|r| {
            #[allow(clippy::cast_precision_loss)]
            let n = r.hosts as f64;
            let v = match i {
                0 => r.round_median_s,
                1 => r.join_s,
                2 => r.etcd_sent_per_round,
                _ => r.etcd_cpu_per_round_s,
            };
            (n, v)
        })
        .collect()
}

/// Each series' fit over `rows`.
fn fits_of(rows: &[&FleetRow]) -> [Option<Fit>; 4] {
    [0, 1, 2, 3].map(|i| fit(&series_of(rows, i)))
}

/// Seconds in the unit that reads best.
fn time(s: f64) -> String {
    if s >= 10.0 {
        format!("{s:.1} s")
    } else if s >= 1.0 {
        format!("{:.0} ms", s * 1e3)
    } else {
        format!("{:.1} ms", s * 1e3)
    }
}

/// Bytes in the unit that reads best.
#[allow(clippy::cast_precision_loss)]
fn bytes(b: f64) -> String {
    if b >= 1e6 {
        format!("{:.1} MB", b / 1e6)
    } else if b >= 1e3 {
        format!("{:.1} KB", b / 1e3)
    } else {
        format!("{b:.0} B")
    }
}

fn value(v: f64, unit: &str) -> String {
    if unit == "B" { bytes(v) } else { time(v) }
}

/// One set-up's section of [`markdown`]: its table, its faults table (a
/// cluster) and its fitted exponents with the 12,500-host extrapolation.
#[allow(clippy::cast_precision_loss)]
fn setup_section(out: &mut String, title: &str, rows: &[&FleetRow]) {
    // A host's memory, saying what was counted.
    let memory = |b: u64, what: &str| {
        let what = if what.is_empty() { "rss" } else { what };
        format!("{} {what}", bytes(b as f64))
    };
    let _ = writeln!(
        out,
        "\n{title}:\n\n| hosts (full) | join, all hosts | restart round, median | p90 | lost host, beyond the TTL | a new host joins | spare swap, lost host, beyond the TTL | spare swap, cordon | etcd sent per round | etcd received per round | etcd CPU per round (of it, at the idle rate) | fleet CPU per round | round record | memory per light host | memory per full host | etcd memory | load | commit |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in rows {
        let _ = writeln!(
            out,
            "| {} ({}) | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} ms{} | {:.0} ms | {} | {} | {} | {} | {:.1} | {} |",
            r.hosts,
            r.full,
            time(r.join_s),
            time(r.round_median_s),
            time(r.round_p90_s),
            time(r.lost_s - r.ttl_s),
            time(r.replaced_s),
            time(r.swap_lost_s - r.ttl_s),
            time(r.swap_cordon_s),
            bytes(r.etcd_sent_per_round),
            bytes(r.etcd_received_per_round),
            r.etcd_cpu_per_round_s * 1e3,
            if r.etcd_idle_cpu_per_round_s > 0.0 {
                format!(" ({:.0} ms)", r.etcd_idle_cpu_per_round_s * 1e3)
            } else {
                String::new()
            },
            r.fleet_cpu_per_round_s * 1e3,
            bytes(r.round_record_bytes as f64),
            memory(r.rss_per_light, &r.memory),
            memory(r.rss_per_full, &r.memory),
            bytes(r.etcd_rss as f64),
            r.load,
            r.commit,
        );
    }
    if rows
        .iter()
        .any(|r| r.leader_kill.is_some() || r.member_pause.is_some())
    {
        let _ = writeln!(
            out,
            "\n| hosts | fault | rounds during it | the round it hit | longest | median | requests asked again | leases kept |\n|---|---|---|---|---|---|---|---|"
        );
        for r in rows {
            for (name, f) in [
                ("leader SIGKILLed".to_owned(), &r.leader_kill),
                (
                    r.member_pause.as_ref().map_or(String::new(), |p| {
                        format!("follower SIGSTOPped {:.0} s", p.fault_s)
                    }),
                    &r.member_pause,
                ),
            ] {
                let Some(f) = f else { continue };
                let kept = if f.leases_kept {
                    "all".to_owned()
                } else {
                    format!("**no**: {} lost", f.leases_lost)
                };
                let _ = writeln!(
                    out,
                    "| {} | {name} | {} | {} | {} | {} | {} | {kept} |",
                    r.hosts,
                    f.rounds,
                    time(f.hit_s),
                    time(f.max_s),
                    time(f.median_s),
                    f.refused
                );
            }
        }
    }
    let _ = writeln!(out);
    for ((name, unit), f) in SERIES.iter().zip(fits_of(rows)) {
        let Some(f) = f else { continue };
        let _ = writeln!(
            out,
            "- {name}: N^{:.2} (least squares on log-log over {} host counts); at 12,500 hosts, extrapolated: {}",
            f.exponent,
            f.points,
            value(f.at(12_500.0), unit)
        );
    }
}

/// The results as markdown: per etcd set-up, the table, the faults table
/// (a cluster) and the fitted exponents with the 12,500-host
/// extrapolation.
pub fn markdown(results: &FleetResults) -> String {
    let mut out = String::new();
    for members in results.setups() {
        setup_section(
            &mut out,
            &format!("{members}-member etcd"),
            &results.rows_of(members),
        );
    }
    for ((version, members), rows) in results.other_etcd() {
        setup_section(
            &mut out,
            &format!(
                "etcd {version}, {members} member{} (a set-up of its own: not in the fits above, the plot or the planner)",
                if members == 1 { "" } else { "s" }
            ),
            &rows,
        );
    }
    let proxied = results.proxied();
    if !proxied.is_empty() {
        let _ = writeln!(
            out,
            "\nThrough etcd gRPC proxies (host i through proxy i mod P):\n\n| etcd | members | proxies | hosts (full) | join, all hosts | restart round, median | p90 | lost host, beyond the TTL | etcd sent per round | etcd CPU per round (of it, at the idle rate) | proxies' CPU per round | etcd memory | proxies' memory | leader SIGKILLed: longest round, leases lost | follower SIGSTOPped: longest round, leases lost | load | commit |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        let fault = |f: &Option<FaultRounds>| {
            f.as_ref().map_or_else(
                || "-".to_owned(),
                |f| format!("{}, {}", time(f.max_s), f.leases_lost),
            )
        };
        for r in proxied {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} ({}) | {} | {} | {} | {} | {} | {:.0} ms ({:.0} ms) | {:.0} ms | {} | {} | {} | {} | {:.1} | {} |",
                r.version(),
                r.etcd_members,
                r.proxies,
                r.hosts,
                r.full,
                time(r.join_s),
                time(r.round_median_s),
                time(r.round_p90_s),
                time(r.lost_s - r.ttl_s),
                bytes(r.etcd_sent_per_round),
                r.etcd_cpu_per_round_s * 1e3,
                r.etcd_idle_cpu_per_round_s * 1e3,
                r.proxy_cpu_per_round_s * 1e3,
                bytes(r.etcd_rss as f64),
                bytes(r.proxy_rss as f64),
                fault(&r.leader_kill),
                fault(&r.member_pause),
                r.load,
                r.commit,
            );
        }
    }
    out
}

/// Escapes text for XML.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

const PANEL_W: f64 = 380.0;
const PANEL_H: f64 = 260.0;
const MARGIN_L: f64 = 70.0;
const MARGIN_B: f64 = 40.0;
const MARGIN_T: f64 = 30.0;
const COLORS: [&str; 2] = ["#1f77b4", "#d62728"];

/// The four series against N on log-log axes, one panel each: each etcd
/// set-up's measured points, its fitted line extended to 12,500 hosts
/// (dashed past the last measured N: an extrapolation) and its exponent.
#[allow(clippy::cast_precision_loss)]
pub fn svg(results: &FleetResults) -> String {
    let setups = results.setups();
    let width = 2.0 * PANEL_W;
    let height = 2.0 * PANEL_H + 40.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        s,
        r#"<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>"#
    );
    let legend: Vec<String> = setups
        .iter()
        .enumerate()
        .map(|(k, m)| {
            format!(
                r#"<tspan fill="{}">&#9679; {m}-member etcd</tspan>"#,
                COLORS[k % COLORS.len()]
            )
        })
        .collect();
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">fleet bench against N hosts (log-log). Points measured; lines fitted; dashed: extrapolated to 12,500. {}</text>"#,
        width / 2.0,
        height - 12.0,
        legend.join(" ")
    );
    for (i, (name, unit)) in SERIES.iter().enumerate() {
        let ox = (i % 2) as f64 * PANEL_W;
        let oy = (i / 2) as f64 * PANEL_H;
        let all: Vec<(f64, f64)> = setups
            .iter()
            .flat_map(|m| results.series(*m, i))
            .filter(|p| p.1 > 0.0)
            .collect();
        let fits: Vec<Option<Fit>> = setups.iter().map(|m| fit(&results.series(*m, i))).collect();
        let mut ys: Vec<f64> = all.iter().map(|p| p.1).collect();
        ys.extend(fits.iter().flatten().map(|f| f.at(12_500.0)));
        let x_lo = all
            .iter()
            .map(|p| p.0)
            .fold(f64::INFINITY, f64::min)
            .min(16.0);
        let x_hi = 12_500.0f64;
        let y_lo = ys.iter().copied().fold(f64::INFINITY, f64::min);
        let y_hi = ys.iter().copied().fold(0.0, f64::max);
        if !y_lo.is_finite() || y_hi <= 0.0 {
            continue;
        }
        let (y_lo, y_hi) = (
            10f64.powf(y_lo.log10().floor()),
            10f64.powf(y_hi.log10().ceil()),
        );
        let pw = PANEL_W - MARGIN_L - 20.0;
        let ph = PANEL_H - MARGIN_T - MARGIN_B;
        let x = |n: f64| ox + MARGIN_L + (n.ln() - x_lo.ln()) / (x_hi.ln() - x_lo.ln()) * pw;
        let y = |v: f64| {
            oy + MARGIN_T + (1.0 - (v.ln() - y_lo.ln()) / (y_hi.ln() - y_lo.ln()).max(1e-12)) * ph
        };
        let exps: Vec<String> = setups
            .iter()
            .zip(&fits)
            .filter_map(|(m, f)| f.map(|f| format!("{m}: N^{:.2}", f.exponent)))
            .collect();
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle" font-size="12">{} ({})</text>"#,
            ox + MARGIN_L + pw / 2.0,
            oy + 18.0,
            esc(name),
            esc(&exps.join(", "))
        );
        let _ = writeln!(
            s,
            r#"<rect x="{}" y="{}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#,
            ox + MARGIN_L,
            oy + MARGIN_T
        );
        for n in [16.0, 128.0, 1024.0, 2048.0, 12_500.0] {
            if n < x_lo {
                continue;
            }
            let _ = writeln!(
                s,
                r##"<line x1="{0}" y1="{1}" x2="{0}" y2="{2}" stroke="#ddd"/><text x="{0}" y="{3}" text-anchor="middle">{4}</text>"##,
                x(n),
                oy + MARGIN_T,
                oy + MARGIN_T + ph,
                oy + MARGIN_T + ph + 14.0,
                n
            );
        }
        let mut d = y_lo;
        while d <= y_hi * 1.001 {
            let _ = writeln!(
                s,
                r##"<line x1="{0}" y1="{1}" x2="{2}" y2="{1}" stroke="#ddd"/><text x="{3}" y="{4}" text-anchor="end">{5}</text>"##,
                ox + MARGIN_L,
                y(d),
                ox + MARGIN_L + pw,
                ox + MARGIN_L - 4.0,
                y(d) + 4.0,
                value(d, unit)
            );
            d *= 10.0;
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">hosts</text>"#,
            ox + MARGIN_L + pw / 2.0,
            oy + MARGIN_T + ph + 30.0
        );
        for (k, m) in setups.iter().enumerate() {
            let color = COLORS[k % COLORS.len()];
            let points = results.series(*m, i);
            for (n, v) in points.iter().filter(|p| p.1 > 0.0) {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{color}"/>"#,
                    x(*n),
                    y(*v)
                );
            }
            if let Some(f) = fits[k] {
                let lo = points.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
                let hi = points.iter().map(|p| p.0).fold(0.0, f64::max);
                let _ = writeln!(
                    s,
                    r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}"/>"#,
                    x(lo),
                    y(f.at(lo)),
                    x(hi),
                    y(f.at(hi))
                );
                let _ = writeln!(
                    s,
                    r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-dasharray="4 3"/>"#,
                    x(hi),
                    y(f.at(hi)),
                    x(12_500.0),
                    y(f.at(12_500.0))
                );
            }
        }
    }
    let _ = writeln!(s, "</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(members: u32, hosts: u64, round: f64) -> FleetRow {
        FleetRow {
            hosts,
            etcd_members: members,
            round_median_s: round,
            join_s: round * 10.0,
            etcd_sent_per_round: round * 1e6,
            etcd_cpu_per_round_s: round / 2.0,
            ..FleetRow::default()
        }
    }

    #[test]
    fn a_power_law_is_fitted_exactly() {
        let points: Vec<(f64, f64)> = [16.0, 256.0, 2048.0]
            .iter()
            .map(|n: &f64| (*n, 0.003 * n.powf(1.5)))
            .collect();
        let f = fit(&points).unwrap();
        assert!((f.exponent - 1.5).abs() < 1e-9, "{f:?}");
        assert!((f.coefficient - 0.003).abs() < 1e-9, "{f:?}");
        assert!((f.at(100.0) - 3.0).abs() < 1e-6);
    }

    #[test]
    fn one_host_count_or_none_positive_is_no_curve() {
        assert_eq!(fit(&[(16.0, 1.0)]), None);
        assert_eq!(fit(&[(16.0, 1.0), (16.0, 2.0)]), None);
        assert_eq!(fit(&[(16.0, 0.0), (256.0, 0.0)]), None);
    }

    /// A row measured through etcd gRPC proxies is a set-up of its own:
    /// the planner's round, the fits and the plot never take it for the
    /// members' own (it is listed apart, in the markdown too).
    #[test]
    fn rows_through_proxies_are_kept_apart() {
        let mut proxied = row(3, 2048, 0.1);
        proxied.proxies = 4;
        proxied.proxy_cpu_per_round_s = 0.089;
        let r = FleetResults {
            rows: vec![row(3, 16, 0.002), row(3, 2048, 0.5), proxied],
        };
        assert_eq!(r.setups(), [3]);
        assert_eq!(r.rows_of(3).len(), 2);
        assert_eq!(r.proxied().len(), 1);
        let at = r.round_at(2048).unwrap();
        assert_eq!((at.basis, at.seconds), (FigureBasis::Measured, 0.5));
        let text = markdown(&r);
        assert!(text.contains("Through etcd gRPC proxies"), "{text}");
        assert!(text.contains("| 3.4 | 3 | 4 | 2048 (0) |"), "{text}");
        assert!(text.contains("| 89 ms |"), "{text}");
        // Only proxied rows: no set-up, no curve.
        let only = FleetResults {
            rows: vec![r.rows[2].clone()],
        };
        assert!(only.setups().is_empty());
        assert!(only.round_at(2048).is_err());
    }

    /// A row on another etcd line than the tests' 3.4 is a set-up of its
    /// own: its own table and fits, never mixed into the 3.4 curve the
    /// planner reads.
    #[test]
    fn rows_on_another_etcd_are_kept_apart() {
        let on = |version: &str, hosts, s| {
            let mut r = row(1, hosts, s);
            r.etcd_version = version.to_owned();
            r
        };
        let r = FleetResults {
            rows: vec![
                row(1, 16, 0.002),
                on("3.4.23", 2048, 0.07),
                on("3.5.1", 16, 0.001),
                on("3.5.1", 2048, 0.03),
            ],
        };
        assert_eq!(r.setups(), [1]);
        assert_eq!(r.rows_of(1).len(), 2, "3.4.23 is the default line");
        let at = r.round_at(2048).unwrap();
        assert_eq!((at.basis, at.seconds), (FigureBasis::Measured, 0.07));
        let other = r.other_etcd();
        assert_eq!(other.len(), 1);
        assert_eq!(other[0].0, ("3.5.1".to_owned(), 1));
        assert_eq!(other[0].1.len(), 2);
        let text = markdown(&r);
        assert!(
            text.contains("etcd 3.5.1, 1 member (a set-up of its own"),
            "{text}"
        );
        // Its own fit: 0.001 s to 0.03 s over 16 to 2,048 hosts.
        let fits: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("- restart round"))
            .collect();
        assert_eq!(fits.len(), 2, "{text}");
        assert_ne!(fits[0], fits[1], "{text}");
        // The field round-trips, and rows without it read as 3.4.
        let json = serde_json::to_string(&r).unwrap();
        let back = FleetResults::parse(&json).unwrap();
        assert_eq!(back.rows[3].etcd_version, "3.5.1");
        assert!(back.rows[0].on_default_etcd() && back.rows[0].version() == "3.4");
        // A re-run replaces the row of its set-up: a row from before the
        // version was recorded is the same 3.4 set-up as a 3.4.23 one.
        assert!(on("3.4.23", 16, 0.002).same_setup(&row(1, 16, 0.001)));
        assert!(!on("3.5.1", 16, 0.002).same_setup(&row(1, 16, 0.001)));
        assert!(on("3.5.1", 16, 0.002).same_setup(&on("3.5.1", 16, 0.1)));
        assert!(!on("3.5.1", 2048, 0.002).same_setup(&on("3.5.1", 16, 0.1)));
    }

    #[test]
    fn the_round_is_measured_interpolated_or_extrapolated_and_prefers_the_cluster() {
        let r = FleetResults {
            rows: vec![
                row(1, 16, 0.001),
                row(1, 2048, 0.4),
                row(3, 16, 0.002),
                row(3, 256, 0.02),
                row(3, 2048, 0.5),
            ],
        };
        let at = r.round_at(2048).unwrap();
        assert_eq!(
            (at.basis, at.etcd_members, at.seconds),
            (FigureBasis::Measured, 3, 0.5)
        );
        let at = r.round_at(1000).unwrap();
        assert_eq!(at.basis, FigureBasis::Interpolated);
        assert!(at.seconds > 0.02 && at.seconds < 0.5, "{at:?}");
        let at = r.round_at(12_500).unwrap();
        assert_eq!(at.basis, FigureBasis::Extrapolated);
        assert!(at.seconds > 0.5, "{at:?}");
        assert!(at.label().contains("extrapolated"), "{}", at.label());
        // A single member only: its rows.
        let single = FleetResults {
            rows: vec![row(1, 16, 0.001), row(1, 2048, 0.4), row(3, 16, 0.002)],
        };
        assert_eq!(single.round_at(2048).unwrap().etcd_members, 1);
        assert!(FleetResults::default().round_at(16).is_err());
    }

    #[test]
    fn a_measurement_on_one_set_up_beats_an_extrapolation_on_another() {
        let r = FleetResults {
            rows: vec![
                row(1, 16, 0.002),
                row(1, 2048, 0.07),
                row(1, 12_500, 0.6),
                row(3, 16, 0.002),
                row(3, 2048, 0.08),
            ],
        };
        // Within the cluster's range: the cluster's.
        let at = r.round_at(2048).unwrap();
        assert_eq!((at.etcd_members, at.basis), (3, FigureBasis::Measured));
        // Past it, where the single member measured: the single member's.
        let at = r.round_at(12_500).unwrap();
        assert_eq!(
            (at.etcd_members, at.basis, at.seconds),
            (1, FigureBasis::Measured, 0.6)
        );
        let at = r.round_at(8192).unwrap();
        assert_eq!((at.etcd_members, at.basis), (1, FigureBasis::Interpolated));
        // Past every set-up's rows: the curve measured farthest, extended.
        let at = r.round_at(20_000).unwrap();
        assert_eq!((at.etcd_members, at.basis), (1, FigureBasis::Extrapolated));
        assert!(at.seconds > 0.6, "{at:?}");
    }

    #[test]
    fn the_committed_results_parse_and_give_a_curve() {
        let r = embedded().unwrap();
        let at = r.round_at(2048).unwrap();
        assert!(at.seconds > 0.0, "{at:?}");
        assert!(at.fit.exponent.is_finite());
    }

    #[test]
    fn a_file_of_another_shape_is_refused() {
        let e = FleetResults::parse(r#"{"rows": [{"hosts": 16, "surprise": 1}]}"#).unwrap_err();
        assert!(matches!(e, FleetError::Parse(_)), "{e}");
    }

    #[test]
    fn the_plot_and_tables_name_every_series() {
        let r = FleetResults {
            rows: vec![row(1, 16, 0.001), row(1, 256, 0.01), row(1, 2048, 0.4)],
        };
        let svg = svg(&r);
        for (name, _) in SERIES {
            assert!(svg.contains(name), "{name}");
        }
        let md = markdown(&r);
        assert!(md.contains("at 12,500 hosts, extrapolated"), "{md}");
    }
}
