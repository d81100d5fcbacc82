//! Who a request belongs to, so identical prefixes of different tenants get
//! different keys (no cache sharing, no timing side channel between tenants).
//!
//! Two sources:
//! - the tenant header, set by the platform or client: validated here
//!   (1 to 64 printable ASCII characters); an invalid one is a client error;
//! - the body's top-level `prompt_cache_key` (OpenAI's own field), taken as
//!   is, whatever its length or characters: it is the client's own cache key,
//!   it only ever feeds the hash (never a header or a log), and OpenAI does
//!   not restrict it, so rejecting it would break requests that work without
//!   the filter. The header wins when both are present.

use std::fmt;

/// Longest tenant header value accepted, in bytes.
pub const MAX_TENANT_HEADER_LEN: usize = 64;

/// The rule, stated once for error messages and documentation.
pub const TENANT_HEADER_RULE: &str = "must be 1 to 64 printable ASCII characters (0x20 to 0x7E)";

/// Where the tenant in a key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantSource {
    /// No tenant: the key is shared by everyone with the same prefix.
    None,
    Header,
    /// The body's top-level `prompt_cache_key`.
    Body,
}

/// Why a tenant header value was refused. Displays the rule and what broke
/// it, never the value itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InvalidTenant {
    /// The header came `count` times (Envoy keeps each as its own entry).
    Repeated {
        count: usize,
    },
    Empty,
    TooLong {
        len: usize,
    },
    NotPrintable {
        position: usize,
        byte: u8,
    },
}

impl fmt::Display for InvalidTenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let InvalidTenant::Repeated { count } = self {
            return write!(
                f,
                "the tenant header must be sent once; it was sent {count} times"
            );
        }
        write!(f, "the tenant {TENANT_HEADER_RULE}; ")?;
        match self {
            InvalidTenant::Repeated { .. } => Ok(()),
            InvalidTenant::Empty => write!(f, "it is empty"),
            InvalidTenant::TooLong { len } => write!(f, "it is {len} bytes long"),
            InvalidTenant::NotPrintable { position, byte } => {
                write!(f, "byte {position} is 0x{byte:02X}")
            }
        }
    }
}

impl std::error::Error for InvalidTenant {}

/// Validates a tenant header value; returns it as text when valid.
pub fn validate_header_tenant(value: &[u8]) -> Result<&str, InvalidTenant> {
    if value.is_empty() {
        return Err(InvalidTenant::Empty);
    }
    if value.len() > MAX_TENANT_HEADER_LEN {
        return Err(InvalidTenant::TooLong { len: value.len() });
    }
    if let Some((position, &byte)) = value
        .iter()
        .enumerate()
        .find(|(_, b)| !(0x20..=0x7E).contains(*b))
    {
        return Err(InvalidTenant::NotPrintable { position, byte });
    }
    // Printable ASCII is UTF-8.
    std::str::from_utf8(value).map_err(|_| InvalidTenant::NotPrintable {
        position: 0,
        byte: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_1_to_64_printable_ascii() {
        assert_eq!(validate_header_tenant(b"a"), Ok("a"));
        assert_eq!(
            validate_header_tenant(b" ~team A/42~ "),
            Ok(" ~team A/42~ ")
        );
        let max = "x".repeat(64);
        assert_eq!(validate_header_tenant(max.as_bytes()), Ok(max.as_str()));
        let all: Vec<u8> = (0x20..=0x7E).collect();
        assert!(validate_header_tenant(&all[..64]).is_ok());
        assert!(validate_header_tenant(&all[31..]).is_ok());
    }

    #[test]
    fn rejects_empty_long_and_unprintable() {
        assert_eq!(validate_header_tenant(b""), Err(InvalidTenant::Empty));
        assert_eq!(
            validate_header_tenant("x".repeat(65).as_bytes()),
            Err(InvalidTenant::TooLong { len: 65 })
        );
        for (value, position, byte) in [
            (&b"ab\tc"[..], 2, 0x09),
            (b"\x7F", 0, 0x7F),
            (b"\x1F", 0, 0x1F),
            ("é".as_bytes(), 0, 0xC3),
            (b"ok\x00", 2, 0x00),
        ] {
            assert_eq!(
                validate_header_tenant(value),
                Err(InvalidTenant::NotPrintable { position, byte })
            );
        }
    }

    #[test]
    fn message_states_the_rule_and_the_fault() {
        assert_eq!(
            InvalidTenant::TooLong { len: 70 }.to_string(),
            "the tenant must be 1 to 64 printable ASCII characters (0x20 to 0x7E); it is 70 bytes long"
        );
        assert_eq!(
            InvalidTenant::NotPrintable {
                position: 3,
                byte: 0x0A
            }
            .to_string(),
            "the tenant must be 1 to 64 printable ASCII characters (0x20 to 0x7E); byte 3 is 0x0A"
        );
        assert!(InvalidTenant::Empty.to_string().ends_with("it is empty"));
    }
}
