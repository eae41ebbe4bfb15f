//! A job's hosts in node-rank order as this agent knows them: the whole
//! order, or some of its places (a partial view, issue 30).
//!
//! The job-wide exchange's tree and the restore's collectors are cut from
//! the order by index ([`warden_core::detect::straggler::tree`]). A host
//! of a 12,500-host job needs about 2√N of those places (its own group and
//! group 0: `tree::needed`), not all of them; an order that keeps only the
//! places handed over, at their indices, lets the launcher hand over that
//! much and every index keep its meaning. Indexed by binary search over
//! the known places; a whole order is a plain vector.

use std::ops::Range;

/// A job's order: `len` places, each known (an agent's address) or not.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Order {
    /// How many hosts the job's order has.
    len: usize,
    /// The known places, ascending; empty where every place is known
    /// (`addrs` is then the whole order).
    places: Vec<usize>,
    /// The known places' addresses, in the order of `places`.
    addrs: Vec<String>,
}

/// Why a partial order was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OrderError {
    /// A place at or past the order's length.
    #[error("place {place} ({addr:?}) is past the job's {len} hosts")]
    PastEnd {
        /// The place given.
        place: usize,
        /// Its address.
        addr: String,
        /// The order's length.
        len: usize,
    },
    /// Two addresses at one place.
    #[error("place {place} is given twice ({first:?} and {second:?})")]
    Twice {
        /// The place.
        place: usize,
        /// The first address given for it.
        first: String,
        /// The second.
        second: String,
    },
}

impl Order {
    /// The whole order: `addrs[i]` at place `i`.
    pub fn whole(addrs: Vec<String>) -> Self {
        Self {
            len: addrs.len(),
            places: Vec::new(),
            addrs,
        }
    }

    /// An order of `len` places of which `known` (place, address) are
    /// known, in any order; every place known makes a whole order.
    pub fn partial(len: usize, mut known: Vec<(usize, String)>) -> Result<Self, OrderError> {
        known.sort_by_key(|(p, _)| *p);
        for w in known.windows(2) {
            if w[0].0 == w[1].0 {
                return Err(OrderError::Twice {
                    place: w[0].0,
                    first: w[0].1.clone(),
                    second: w[1].1.clone(),
                });
            }
        }
        if let Some((place, addr)) = known.last()
            && *place >= len
        {
            return Err(OrderError::PastEnd {
                place: *place,
                addr: addr.clone(),
                len,
            });
        }
        let whole = known.len() == len;
        let (places, addrs): (Vec<usize>, Vec<String>) = known.into_iter().unzip();
        Ok(Self {
            len,
            places: if whole { Vec::new() } else { places },
            addrs,
        })
    }

    /// How many hosts the job's order has, known here or not.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the order has no place at all (no job handed over).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many of its places are known here.
    pub fn known(&self) -> usize {
        self.addrs.len()
    }

    /// Whether every place is known.
    pub fn is_whole(&self) -> bool {
        self.addrs.len() == self.len
    }

    /// The address at place `i`; None past the end or not known here.
    pub fn get(&self, i: usize) -> Option<&str> {
        if self.is_whole() {
            return self.addrs.get(i).map(String::as_str);
        }
        let j = self.places.binary_search(&i).ok()?;
        self.addrs.get(j).map(String::as_str)
    }

    /// The known places in `r` and their addresses, ascending.
    pub fn range(&self, r: Range<usize>) -> impl Iterator<Item = (usize, &str)> {
        let end = r.end.min(self.len);
        let start = r.start.min(end);
        let (from, to) = if self.is_whole() {
            (start, end)
        } else {
            (
                self.places.partition_point(|p| *p < start),
                self.places.partition_point(|p| *p < end),
            )
        };
        (from..to).map(move |j| {
            let place = if self.places.is_empty() {
                j
            } else {
                self.places[j]
            };
            (place, self.addrs[j].as_str())
        })
    }

    /// The addresses of the known places in `r`, ascending.
    pub fn addrs_in(&self, r: Range<usize>) -> Vec<String> {
        self.range(r).map(|(_, a)| a.to_owned()).collect()
    }

    /// The first place of `addr`, a scan (once per hand-over, not per
    /// call).
    pub fn position(&self, addr: &str) -> Option<usize> {
        self.range(0..self.len)
            .find(|(_, a)| *a == addr)
            .map(|(p, _)| p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(i: usize) -> String {
        format!("127.0.0.{i}:7000")
    }

    #[test]
    fn a_whole_order_is_indexed_as_its_list() {
        let o = Order::whole((0..5).map(a).collect());
        assert_eq!((o.len(), o.known(), o.is_whole()), (5, 5, true));
        assert_eq!(o.get(3), Some(a(3).as_str()));
        assert_eq!(o.get(5), None);
        assert_eq!(o.addrs_in(1..3), [a(1), a(2)]);
        assert_eq!(o.addrs_in(4..99), [a(4)]);
        assert_eq!(o.addrs_in(7..9), Vec::<String>::new());
        assert_eq!(o.position(&a(4)), Some(4));
        assert!(Order::default().is_empty());
    }

    #[test]
    fn a_partial_order_keeps_each_place_at_its_index() {
        // A host at place 7 of 12, groups of 3: group 0 and its own.
        let known = [7usize, 0, 2, 6, 1, 8].map(|p| (p, a(p))).to_vec();
        let o = Order::partial(12, known).expect("valid");
        assert_eq!((o.len(), o.known(), o.is_whole()), (12, 6, false));
        assert_eq!(o.get(7), Some(a(7).as_str()));
        assert_eq!(o.get(3), None, "group 1 is not known here");
        assert_eq!(o.get(11), None);
        assert_eq!(o.get(12), None);
        assert_eq!(o.range(0..3).map(|(p, _)| p).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(o.addrs_in(3..6), Vec::<String>::new());
        assert_eq!(o.addrs_in(6..9), [a(6), a(7), a(8)]);
        assert_eq!(o.addrs_in(5..100), [a(6), a(7), a(8)]);
        assert_eq!(o.position(&a(8)), Some(8));
        assert_eq!(o.position(&a(3)), None);
        // Every place given: a whole order.
        let all = Order::partial(3, [2, 0, 1].map(|p| (p, a(p))).to_vec()).expect("valid");
        assert!(all.is_whole());
        assert_eq!(all, Order::whole((0..3).map(a).collect()));
    }

    #[test]
    fn a_place_past_the_end_or_given_twice_is_refused_by_name() {
        let past = Order::partial(4, vec![(1, a(1)), (4, a(4))]).unwrap_err();
        assert_eq!(
            past.to_string(),
            format!("place 4 ({:?}) is past the job's 4 hosts", a(4))
        );
        let twice = Order::partial(4, vec![(1, a(1)), (1, a(2))]).unwrap_err();
        assert!(
            twice.to_string().starts_with("place 1 is given twice"),
            "{twice}"
        );
    }
}
