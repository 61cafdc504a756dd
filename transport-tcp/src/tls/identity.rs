//! The name a verified certificate gives its holder: what a handler sees
//! as [`Peer::identity`](rpc_core::intercept::Peer::identity).
//!
//! In order: the first DNS name among its subject alternative names; else
//! its subject's common name (CN); else its subject's other attributes
//! (`O=Acme, OU=ML`); else `serial:` and its serial number in hex. Only
//! certificates rustls already verified (signed by the CA trusted for
//! clients) are named, and control characters are left out, so a name is
//! safe to log.

use rustls_pki_types::CertificateDer;

/// The name of the holder of `certificate` (see the module docs).
pub(crate) fn of(certificate: &CertificateDer<'_>) -> String {
    let Ok(cert) = webpki::EndEntityCert::try_from(certificate) else {
        return "unparsable certificate".into();
    };
    if let Some(name) = cert.valid_dns_names().next() {
        return printable(name);
    }
    let attributes: Vec<(&'static str, String)> = attributes(cert.subject())
        .into_iter()
        .filter_map(|(oid, value)| Some((short_name(oid)?, value)))
        .collect();
    if let Some((_, cn)) = attributes.iter().find(|(name, _)| *name == "CN") {
        return cn.clone();
    }
    if !attributes.is_empty() {
        let parts: Vec<String> = attributes
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        return parts.join(", ");
    }
    let serial: String = cert.serial().iter().map(|b| format!("{b:02x}")).collect();
    format!("serial:{serial}")
}

fn printable(text: &str) -> String {
    text.chars().filter(|c| !c.is_control()).collect()
}

/// Short names of the attributes a readable subject shows (OIDs 2.5.4.x).
fn short_name(oid: &[u8]) -> Option<&'static str> {
    Some(match oid {
        [0x55, 0x04, 0x03] => "CN",
        [0x55, 0x04, 0x06] => "C",
        [0x55, 0x04, 0x07] => "L",
        [0x55, 0x04, 0x08] => "ST",
        [0x55, 0x04, 0x0a] => "O",
        [0x55, 0x04, 0x0b] => "OU",
        _ => return None,
    })
}

/// One DER element: its tag, its contents, and what follows it. `None` if
/// it does not fit in `input` (lengths over 4 bytes are refused).
fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let (len, rest) = rest.split_at(n);
        (
            len.iter().fold(0usize, |acc, &b| acc << 8 | usize::from(b)),
            rest,
        )
    };
    if rest.len() < len {
        return None;
    }
    let (contents, rest) = rest.split_at(len);
    Some((tag, contents, rest))
}

/// A subject's attributes as (OID, string value), from the contents of its
/// `Name` (a SEQUENCE of SETs of SEQUENCE { OID, value }). Values that are
/// not strings are skipped; parsing stops at the first malformed element.
fn attributes(mut name: &[u8]) -> Vec<(&[u8], String)> {
    let mut found = Vec::new();
    while let Some((0x31, mut set, rest)) = element(name) {
        name = rest;
        while let Some((0x30, pair, rest)) = element(set) {
            set = rest;
            let Some((0x06, oid, value)) = element(pair) else {
                return found;
            };
            if let Some(value) = element(value).and_then(|(tag, v, _)| string(tag, v)) {
                found.push((oid, value));
            }
        }
    }
    found
}

/// A DER string's text, control characters left out.
fn string(tag: u8, value: &[u8]) -> Option<String> {
    let text = match tag {
        // UTF8String, PrintableString, IA5String, TeletexString (taken as UTF-8).
        0x0c | 0x13 | 0x16 | 0x14 => String::from_utf8_lossy(value).into_owned(),
        // BMPString: UTF-16, big-endian.
        0x1e => char::decode_utf16(
            value
                .chunks_exact(2)
                .map(|pair| u16::from_be_bytes([pair[0], pair[1]])),
        )
        .map(|c| c.unwrap_or(char::REPLACEMENT_CHARACTER))
        .collect(),
        _ => return None,
    };
    Some(printable(&text))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn certificate(sans: &[&str], subject: &[(rcgen::DnType, &str)]) -> CertificateDer<'static> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params =
            rcgen::CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        for (kind, value) in subject {
            params.distinguished_name.push(kind.clone(), *value);
        }
        params.self_signed(&key).unwrap().der().clone()
    }

    #[test]
    fn the_first_dns_name_comes_first() {
        let cert = certificate(
            &["127.0.0.1", "worker-7.ml.internal", "other.internal"],
            &[(rcgen::DnType::CommonName, "ignored")],
        );
        assert_eq!(of(&cert), "worker-7.ml.internal");
    }

    #[test]
    fn without_a_dns_name_the_common_name() {
        let cert = certificate(
            &["10.0.0.5"],
            &[
                (rcgen::DnType::OrganizationName, "Acme"),
                (rcgen::DnType::CommonName, "trainer-3"),
            ],
        );
        assert_eq!(of(&cert), "trainer-3");
        let cert = certificate(&[], &[(rcgen::DnType::CommonName, "bell\u{7}")]);
        assert_eq!(of(&cert), "bell", "control characters are left out");
    }

    #[test]
    fn without_a_common_name_the_other_attributes_then_the_serial() {
        let cert = certificate(
            &[],
            &[
                (rcgen::DnType::OrganizationName, "Acme"),
                (rcgen::DnType::OrganizationalUnitName, "ML"),
            ],
        );
        assert_eq!(of(&cert), "O=Acme, OU=ML");
        let cert = certificate(&[], &[]);
        assert!(of(&cert).starts_with("serial:"), "{}", of(&cert));
    }

    #[test]
    fn malformed_names_end_the_walk_without_panicking() {
        for bytes in [
            &[0x31, 0x05, 0x30][..],
            &[0x31, 0x84, 0xff, 0xff, 0xff, 0xff],
            &[0x31],
        ] {
            assert!(attributes(bytes).is_empty());
        }
    }
}
