//! A rank's recent step records, kept for the straggler detector: per step,
//! the step's duration and each section's total. The scan feeds it (under
//! the registry lock, so it must be cheap); the detector copies it out.
//!
//! Bounded: [`MAX_WINDOW`] steps and [`TRACKED_SECTIONS`] distinct section
//! names per rank; the ring is allocated once, on the first step.

use std::collections::VecDeque;

use super::config::MAX_WINDOW;

/// Distinct section names kept per rank; a training loop marks a handful.
/// Names past it are not tracked (their time still counts in the step).
pub const TRACKED_SECTIONS: usize = 8;

/// One completed step: its duration and each tracked section's total in it
/// (0: the section did not run in this step).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepRow {
    /// The whole step, nanoseconds.
    pub step_ns: u64,
    /// Per tracked section (index into [`RankSamples::names`]), nanoseconds.
    pub ns: [u64; TRACKED_SECTIONS],
}

/// The recent steps of one rank.
#[derive(Debug, Clone, Default)]
pub struct RankSamples {
    /// Section names by tracked index, in the order first seen.
    names: Vec<String>,
    /// The last [`MAX_WINDOW`] steps, oldest first.
    rows: VecDeque<StepRow>,
    /// Steps pushed since registration (never decreases): the detector
    /// compares it with what it last scored to see new steps.
    pushed: u64,
    /// Per tracked section, how many kept steps ran it (kept up to date on
    /// push, so a window need not count the whole ring).
    present: [u32; TRACKED_SECTIONS],
}

impl RankSamples {
    /// Records one completed step; `sections` are (name, total ns) pairs.
    pub fn push_step<'a>(
        &mut self,
        step_ns: u64,
        sections: impl IntoIterator<Item = (&'a str, u64)>,
    ) {
        let mut row = StepRow {
            step_ns,
            ..StepRow::default()
        };
        for (name, ns) in sections {
            if let Some(i) = self.index_of(name) {
                row.ns[i] = row.ns[i].saturating_add(ns);
            }
        }
        if self.rows.capacity() == 0 {
            self.rows.reserve_exact(MAX_WINDOW);
        }
        if self.rows.len() >= MAX_WINDOW
            && let Some(old) = self.rows.pop_front()
        {
            for (p, v) in self.present.iter_mut().zip(old.ns) {
                *p -= u32::from(v > 0);
            }
        }
        for (p, v) in self.present.iter_mut().zip(row.ns) {
            *p += u32::from(v > 0);
        }
        self.rows.push_back(row);
        self.pushed += 1;
    }

    /// The tracked index of `name`, adding it while there is room.
    fn index_of(&mut self, name: &str) -> Option<usize> {
        if let Some(i) = self.names.iter().position(|n| n == name) {
            return Some(i);
        }
        if self.names.len() < TRACKED_SECTIONS && !name.is_empty() {
            self.names.push(name.to_owned());
            return Some(self.names.len() - 1);
        }
        None
    }

    /// Section names by tracked index.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The kept steps, oldest first.
    pub fn rows(&self) -> &VecDeque<StepRow> {
        &self.rows
    }

    /// How many kept steps ran tracked section `i`.
    pub fn steps_with(&self, i: usize) -> u32 {
        self.present.get(i).copied().unwrap_or(0)
    }

    /// Steps pushed so far.
    pub fn pushed(&self) -> u64 {
        self.pushed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_steps_and_the_first_names() {
        let mut s = RankSamples::default();
        for i in 0..100u64 {
            s.push_step(
                100 + i,
                [("forward", 10 + i), ("backward", 20), ("forward", 1)],
            );
        }
        assert_eq!(s.pushed(), 100);
        assert_eq!(s.rows().len(), MAX_WINDOW);
        assert_eq!(s.names(), ["forward", "backward"]);
        let last = s.rows().back().unwrap();
        assert_eq!(last.step_ns, 199);
        assert_eq!(last.ns[0], 110, "a section run twice in a step adds up");
        assert_eq!(s.steps_with(0), 64);
        assert_eq!(s.steps_with(1), 64);
        for _ in 0..10 {
            s.push_step(5, [("backward", 1)]);
        }
        assert_eq!((s.steps_with(0), s.steps_with(1)), (54, 64));
        let many: Vec<String> = (0..20).map(|i| format!("s{i}")).collect();
        s.push_step(1, many.iter().map(|n| (n.as_str(), 1)));
        assert_eq!(s.names().len(), TRACKED_SECTIONS);
    }
}
