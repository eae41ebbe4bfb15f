//! Structure-aware inputs: valid seeds, mutated.
//!
//! In: seeds (valid inputs of one target). Out: proptest strategies whose
//! values are the seeds with byte-level edits (bit flips, interesting
//! bytes, insertions, deletions, duplications, splices of another seed),
//! or, for JSON and TOML seeds, with values swapped for hostile ones
//! (huge and negative numbers, wrong types, empty and long strings,
//! deep nesting) and keys dropped. Never: shrinks to anything but a
//! smaller edit of a seed, so a failure reads as "this seed, this change".

use proptest::prelude::*;
use serde_json::Value;

/// One byte-level edit; positions and lengths are taken modulo the input.
#[derive(Debug, Clone)]
enum Edit {
    Flip(usize, u8),
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Duplicate(usize, usize),
    Splice(usize, usize, usize),
}

/// Bytes that parsers treat specially.
const INTERESTING: &[u8] = b"\0\n\r\t \"\\{}[]:,=#.-+0e9\x7f\xff\xc3";

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(p, b)| Edit::Flip(p, b)),
        (any::<usize>(), prop::sample::select(INTERESTING)).prop_map(|(p, b)| Edit::Set(p, b)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(p, v)| Edit::Insert(p, v)),
        (any::<usize>(), 1usize..64).prop_map(|(p, n)| Edit::Delete(p, n)),
        (any::<usize>(), 1usize..64).prop_map(|(p, n)| Edit::Duplicate(p, n)),
        (any::<usize>(), any::<usize>(), 1usize..64).prop_map(|(a, b, n)| Edit::Splice(a, b, n)),
    ]
}

fn apply(mut v: Vec<u8>, edits: &[Edit], other: &[u8]) -> Vec<u8> {
    for e in edits {
        let len = v.len().max(1);
        match e {
            Edit::Flip(p, b) => {
                if let Some(x) = v.get_mut(p % len) {
                    *x ^= 1 << b;
                }
            }
            Edit::Set(p, b) => {
                if let Some(x) = v.get_mut(p % len) {
                    *x = *b;
                }
            }
            Edit::Insert(p, bytes) => {
                let at = p % (v.len() + 1);
                v.splice(at..at, bytes.iter().copied());
            }
            Edit::Delete(p, n) => {
                let at = p % len;
                let end = (at + n).min(v.len());
                if at < end {
                    v.drain(at..end);
                }
            }
            Edit::Duplicate(p, n) => {
                let at = p % len;
                let end = (at + n).min(v.len());
                if at < end {
                    let part = v[at..end].to_vec();
                    v.splice(end..end, part);
                }
            }
            Edit::Splice(a, b, n) => {
                if !other.is_empty() {
                    let from = b % other.len();
                    let part = &other[from..(from + n).min(other.len())];
                    let at = a % (v.len() + 1);
                    v.splice(at..at, part.iter().copied());
                }
            }
        }
    }
    v
}

/// A seed with 1 to 8 byte-level edits.
pub(crate) fn bytes(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let n = seeds.len();
    (0..n, 0..n, prop::collection::vec(edit(), 1..8))
        .prop_map(move |(s, o, edits)| apply(seeds[s].clone(), &edits, &seeds[o]))
}

/// A hostile JSON value for a leaf.
fn hostile_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        Just(Value::from(u64::MAX)),
        Just(Value::from(i64::MIN)),
        Just(Value::from(-1)),
        Just(Value::from(0)),
        Just(serde_json::json!(1e308)),
        Just(serde_json::json!(-0.5)),
        any::<f64>().prop_filter_map("finite", |f| serde_json::Number::from_f64(f)
            .map(Value::Number)),
        ".{0,40}".prop_map(Value::String),
        Just(Value::String("x".repeat(5000))),
        Just(Value::String("../../etc/passwd".into())),
        Just(Value::Array(vec![])),
        Just(serde_json::json!({})),
        Just(serde_json::json!([[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]])),
    ]
}

/// Every leaf (and every object member) of `v`, by a path of indices.
fn slots(v: &Value, here: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
    out.push(here.clone());
    match v {
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                here.push(i);
                slots(x, here, out);
                here.pop();
            }
        }
        Value::Object(m) => {
            for (i, x) in m.values().enumerate() {
                here.push(i);
                slots(x, here, out);
                here.pop();
            }
        }
        _ => {}
    }
}

fn at_mut<'a>(v: &'a mut Value, path: &[usize]) -> Option<&'a mut Value> {
    let Some((first, rest)) = path.split_first() else {
        return Some(v);
    };
    match v {
        Value::Array(a) => at_mut(a.get_mut(*first)?, rest),
        Value::Object(m) => at_mut(m.values_mut().nth(*first)?, rest),
        _ => None,
    }
}

/// One JSON edit: replace the node at a chosen path, or drop it from its
/// parent (an object's key, an array's element).
#[derive(Debug, Clone)]
enum JsonEdit {
    Replace(usize, Value),
    Drop(usize),
}

fn json_edit() -> impl Strategy<Value = JsonEdit> {
    prop_oneof![
        3 => (any::<usize>(), hostile_json()).prop_map(|(p, v)| JsonEdit::Replace(p, v)),
        1 => any::<usize>().prop_map(JsonEdit::Drop),
    ]
}

/// `v` with `edits` applied.
fn edit_json(mut v: Value, edits: &[JsonEdit]) -> Value {
    for e in edits {
        let mut all = Vec::new();
        slots(&v, &mut Vec::new(), &mut all);
        let (JsonEdit::Replace(p, _) | JsonEdit::Drop(p)) = e;
        let path = all[p % all.len()].clone();
        match e {
            JsonEdit::Replace(_, new) => {
                if let Some(node) = at_mut(&mut v, &path) {
                    *node = new.clone();
                }
            }
            JsonEdit::Drop(_) => {
                if let Some((last, parent)) = path.split_last()
                    && let Some(node) = at_mut(&mut v, parent)
                {
                    match node {
                        Value::Array(a) if *last < a.len() => {
                            a.remove(*last);
                        }
                        Value::Object(m) => {
                            if let Some(k) = m.keys().nth(*last).cloned() {
                                m.remove(&k);
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    v
}

/// JSON seeds (parsed once) with 1 to 6 value-level edits.
pub(crate) fn json(seeds: Vec<Value>) -> impl Strategy<Value = Value> {
    let n = seeds.len();
    (0..n, prop::collection::vec(json_edit(), 1..6))
        .prop_map(move |(s, edits)| edit_json(seeds[s].clone(), &edits))
}

/// TOML seeds, edited as JSON and written back as TOML (an edit TOML
/// cannot hold, a null, leaves that key out).
pub(crate) fn toml(seeds: Vec<toml::Table>) -> impl Strategy<Value = String> {
    let seeds: Vec<Value> = seeds
        .into_iter()
        .filter_map(|t| serde_json::to_value(t).ok())
        .collect();
    json(seeds).prop_map(|v| {
        let v = drop_nulls(v);
        toml::to_string(&v).unwrap_or_default()
    })
}

fn drop_nulls(v: Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.into_iter()
                .filter(|(_, x)| !x.is_null())
                .map(|(k, x)| (k, drop_nulls(x)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(
            a.into_iter()
                .filter(|x| !x.is_null())
                .map(drop_nulls)
                .collect(),
        ),
        other => other,
    }
}
