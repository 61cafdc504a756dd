//! Test certificates for `tls://`: CAs and the certificates they sign,
//! written as PEM files in a directory of the test process's own.

#![allow(dead_code)] // each test file uses its own part

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A directory of PEM files, removed when dropped.
pub(crate) struct Files {
    dir: PathBuf,
}

impl Files {
    pub(crate) fn new() -> Files {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "rdma-rpc-tls-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Files { dir }
    }

    pub(crate) fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, contents).unwrap();
        path
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A certificate authority and where its certificate's PEM is.
pub(crate) struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
    pub(crate) cert_file: PathBuf,
}

/// A certificate and its key, as files.
pub(crate) struct Leaf {
    pub(crate) cert_file: PathBuf,
    pub(crate) key_file: PathBuf,
}

/// What a certificate is for.
#[derive(Clone, Copy)]
pub(crate) enum Usage {
    Server,
    Client,
}

impl Ca {
    pub(crate) fn new(files: &Files, name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let cert_file = files.write(&format!("{name}.pem"), &issuer.pem());
        Ca { issuer, cert_file }
    }

    /// A certificate for `names` (DNS names or IP addresses), valid from
    /// 1975 to 4096 unless `expired` (then 2020 to 2021).
    pub(crate) fn issue(
        &self,
        files: &Files,
        file_name: &str,
        names: &[&str],
        usage: Usage,
        expired: bool,
    ) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{file_name} cn"));
        params.extended_key_usages = vec![match usage {
            Usage::Server => ExtendedKeyUsagePurpose::ServerAuth,
            Usage::Client => ExtendedKeyUsagePurpose::ClientAuth,
        }];
        if expired {
            params.not_before = rcgen::date_time_ymd(2020, 1, 1);
            params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        }
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf {
            cert_file: files.write(&format!("{file_name}.pem"), &cert.pem()),
            key_file: files.write(&format!("{file_name}.key"), &key.serialize_pem()),
        }
    }
}

/// `address` with its scheme replaced by `scheme` (the same listener,
/// reached through another registered TLS configuration).
pub(crate) fn on(scheme: &str, address: &str) -> String {
    let (_, authority) = address.split_once("://").unwrap();
    format!("{scheme}://{authority}")
}
