//! Text from outside a process (a peer's report, a caller's request, a
//! source's value), checked or cleaned in one place. A name lands in logs,
//! metric labels and file names, so it must be non-empty, bounded and free
//! of control characters; free text a person reads is clipped and kept to
//! one line.

/// Whether `s` is unfit as a name from outside: empty, over `max` bytes, or
/// holding a control character.
pub fn unfit_name(s: &str, max: usize) -> bool {
    s.is_empty() || s.len() > max || s.chars().any(char::is_control)
}

/// The first `max` bytes of `s`, cut at a character boundary, with each
/// control character replaced by a space.
pub fn clip_line(s: &str, max: usize) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if out.len() + c.len_utf8() > max {
            break;
        }
        out.push(if c.is_control() { ' ' } else { c });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_bounded_and_plain() {
        assert!(!unfit_name("job-1", 5));
        assert!(unfit_name("", 5));
        assert!(unfit_name("job-12", 5));
        assert!(unfit_name("a\nb", 5));
    }

    #[test]
    fn lines_are_clipped_at_a_boundary_and_flattened() {
        assert_eq!(clip_line("a\nb\tc", 10), "a b c");
        assert_eq!(clip_line("abcdef", 4), "abcd");
        // "é" is two bytes: it does not fit in the third.
        assert_eq!(clip_line("abé", 3), "ab");
    }
}
