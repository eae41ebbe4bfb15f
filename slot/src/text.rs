//! Text cut to a byte budget without splitting a character.
//!
//! Here because both sides bound strings before they cross: the slot's
//! section names ([`crate::NAME_LEN`]), and the messages, names and tokens
//! the client and the agent cap before sending or logging them.

/// The longest prefix of `s` of at most `max` bytes that ends on a char boundary.
pub fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while end > 0 && !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
