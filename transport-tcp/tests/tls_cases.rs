//! Every shared transport case (`rpc_test_support::for_each_case!`) over
//! `tls://`: a server with a certificate for 127.0.0.1 signed by a test CA,
//! clients trusting that CA.

mod common;

use std::sync::{Arc, OnceLock};

use common::{Ca, Files, Usage};
use transport_tcp::tls::TlsTransport;

/// Registers `tls://` once per process, with certificates made for it.
fn install_tls() {
    static FILES: OnceLock<Files> = OnceLock::new();
    FILES.get_or_init(|| {
        let files = Files::new();
        let ca = Ca::new(&files, "cases-ca");
        let server = ca.issue(&files, "server", &["127.0.0.1"], Usage::Server, false);
        let tls = TlsTransport::builder()
            .ca_file(&ca.cert_file)
            .cert_file(&server.cert_file)
            .key_file(&server.key_file)
            .build()
            .expect("the test certificates load");
        rpc_core::transport::register(Arc::new(tls));
        files
    });
}

macro_rules! over_tls {
    ($($case:ident),* $(,)?) => {$(
        #[tokio::test]
        async fn $case() {
            install_tls();
            let profile = rpc_test_support::cases::Profile::standard();
            rpc_test_support::cases::$case("tls://127.0.0.1:0".to_string(), &profile).await
        }
    )*};
}

rpc_test_support::for_each_case!(over_tls);
