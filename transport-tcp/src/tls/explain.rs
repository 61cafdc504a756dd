//! What a failed TLS handshake means, in words that say what to fix.
//!
//! rustls reports e.g. `invalid peer certificate: UnknownIssuer`; the
//! messages here say whose certificate it was, which CA file it was checked
//! against, and what to do ("the server's certificate is not signed by a
//! trusted CA (tls-ca /etc/rpc/ca.pem)"), then rustls's own words.

use std::io;
use std::path::Path;

use rustls::{AlertDescription, CertificateError, Error};
use rustls_pki_types::UnixTime;

/// Which end of the handshake this process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// Connecting: the peer is a server.
    Client,
    /// Accepting: the peer is a client.
    Server,
}

impl Side {
    fn peer(self) -> &'static str {
        match self {
            Side::Client => "server",
            Side::Server => "client",
        }
    }
}

/// The rustls error inside an I/O error from tokio-rustls, if any.
fn rustls_error(error: &io::Error) -> Option<&Error> {
    error.get_ref()?.downcast_ref::<Error>()
}

/// `error` from a handshake, its message led by what it means for this
/// side (`ca_file`: the trust roots it was checked against, for messages).
pub(crate) fn handshake_error(side: Side, error: io::Error, ca_file: Option<&Path>) -> io::Error {
    let meaning = match rustls_error(&error) {
        Some(tls) => meaning(side, tls, ca_file),
        None if error.kind() == io::ErrorKind::UnexpectedEof => Some(match side {
            Side::Client => "the server closed the connection during the TLS handshake \
                             (is it a tls:// listener? one that requires a client \
                             certificate may have refused this client's)"
                .to_string(),
            Side::Server => "the client closed the connection during the TLS handshake".into(),
        }),
        None => None,
    };
    match meaning {
        Some(meaning) => io::Error::new(error.kind(), format!("{meaning}: {error}")),
        None => error,
    }
}

/// A read error on an established session: an alert the peer sent gets
/// the same explanation as during the handshake.
pub(crate) fn read_error(side: Side, error: io::Error) -> io::Error {
    match rustls_error(&error).and_then(|tls| meaning(side, tls, None)) {
        Some(meaning) => io::Error::new(error.kind(), format!("{meaning}: {error}")),
        None => error,
    }
}

fn trusted(ca_file: Option<&Path>) -> String {
    match ca_file {
        Some(path) => format!("a trusted CA (tls-ca {})", path.display()),
        None => "a trusted CA".into(),
    }
}

fn meaning(side: Side, error: &Error, ca_file: Option<&Path>) -> Option<String> {
    let peer = side.peer();
    Some(match error {
        Error::InvalidCertificate(certificate) => match certificate {
            CertificateError::UnknownIssuer => format!(
                "the {peer}'s certificate is not signed by {}",
                trusted(ca_file)
            ),
            CertificateError::Expired => format!("the {peer}'s certificate expired; renew it"),
            CertificateError::ExpiredContext { time, not_after } => format!(
                "the {peer}'s certificate expired (valid until {}, now {}); renew it",
                utc(*not_after),
                utc(*time)
            ),
            CertificateError::NotValidYet => {
                format!("the {peer}'s certificate is not valid yet; check both hosts' clocks")
            }
            CertificateError::NotValidYetContext { time, not_before } => format!(
                "the {peer}'s certificate is not valid yet (valid from {}, now {}); \
                 check both hosts' clocks",
                utc(*not_before),
                utc(*time)
            ),
            CertificateError::NotValidForName => {
                format!("the {peer}'s certificate is not valid for the host name connected to")
            }
            CertificateError::NotValidForNameContext {
                expected,
                presented,
            } => format!(
                "the {peer}'s certificate is not valid for {} (it names {}); connect with \
                 a name it carries, or reissue it",
                expected.to_str(),
                if presented.is_empty() {
                    "nothing".to_string()
                } else {
                    presented.join(", ")
                }
            ),
            CertificateError::Revoked => format!("the {peer}'s certificate was revoked"),
            _ => format!("the {peer}'s certificate was refused"),
        },
        Error::NoCertificatesPresented => match side {
            Side::Server => {
                "the client sent no certificate, and this server requires one".to_string()
            }
            Side::Client => "the server sent no certificate".to_string(),
        },
        Error::AlertReceived(alert) => alert_meaning(side, *alert)?,
        Error::InvalidMessage(_) | Error::InappropriateMessage { .. } => {
            format!("the {peer} does not speak TLS (is it a tls:// {peer}, not a tcp:// one?)")
        }
        _ => return None,
    })
}

fn alert_meaning(side: Side, alert: AlertDescription) -> Option<String> {
    use AlertDescription::*;
    Some(match (side, alert) {
        (Side::Client, CertificateRequired) => "the server requires a client certificate: \
             give this client one (TlsTransportBuilder::cert_file and key_file)"
            .to_string(),
        (Side::Client, CertificateExpired) => {
            "the server refused this client's certificate: it expired; renew it".to_string()
        }
        (
            Side::Client,
            UnknownCA
            | BadCertificate
            | CertificateUnknown
            | UnsupportedCertificate
            | AccessDenied
            | DecryptError,
        ) => format!(
            "the server refused this client's certificate ({alert:?}): it must be signed \
             by the CA the server trusts"
        ),
        (Side::Server, CertificateExpired) => {
            "the client refused this server's certificate: it expired; renew it".to_string()
        }
        (
            Side::Server,
            UnknownCA
            | BadCertificate
            | CertificateUnknown
            | UnsupportedCertificate
            | AccessDenied
            | DecryptError,
        ) => format!(
            "the client refused this server's certificate ({alert:?}): is it signed by \
             the CA the client trusts, and valid for the name the client connects to?"
        ),
        _ => return None,
    })
}

/// `2024-03-01 12:00:00 UTC`.
fn utc(time: UnixTime) -> String {
    let secs = time.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days as i64);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        rest / 3600,
        rest / 60 % 60,
        rest % 60
    )
}

/// The proleptic Gregorian date `days` after 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dates_are_printed_in_utc() {
        let at = |secs| utc(UnixTime::since_unix_epoch(Duration::from_secs(secs)));
        assert_eq!(at(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(at(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(at(1_709_294_461), "2024-03-01 12:01:01 UTC");
    }

    #[test]
    fn an_unknown_issuer_names_whose_certificate_and_the_ca_file() {
        let error = io::Error::new(
            io::ErrorKind::InvalidData,
            Error::InvalidCertificate(CertificateError::UnknownIssuer),
        );
        let message = handshake_error(Side::Client, error, Some(Path::new("/etc/ca.pem")));
        assert!(
            message.to_string().starts_with(
                "the server's certificate is not signed by a trusted CA (tls-ca /etc/ca.pem): "
            ),
            "{message}"
        );
    }
}
