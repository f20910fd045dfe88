//! The client's TLS settings, from PEM files: the roots it trusts (the system's, or
//! `--otlp-ca`'s) and its certificate (`--otlp-cert`, `--otlp-key`). Files are checked when the
//! export starts, so a wrong path or a key that is not one fails at once, not at the first send.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use super::{OtlpError, TlsFiles};

/// The largest PEM file read.
const MAX_PEM_BYTES: u64 = 1 << 20;

/// The PEM files' contents, checked.
#[derive(Clone, Default)]
pub(super) struct TlsMaterial {
    /// `--otlp-ca`'s PEM; None: the system's roots.
    pub ca_pem: Option<Vec<u8>>,
    /// `--otlp-cert`'s and `--otlp-key`'s PEM.
    pub identity_pem: Option<(Vec<u8>, Vec<u8>)>,
}

impl TlsMaterial {
    pub fn load(files: &TlsFiles) -> Result<TlsMaterial, OtlpError> {
        let ca_pem = files.ca.as_deref().map(read_pem).transpose()?;
        if let (Some(pem), Some(path)) = (&ca_pem, &files.ca) {
            certificates(pem, path)?;
        }
        let identity_pem = match (&files.cert, &files.key) {
            (Some(cert), Some(key)) => {
                let (cert_pem, key_pem) = (read_pem(cert)?, read_pem(key)?);
                certificates(&cert_pem, cert)?;
                private_key(&key_pem, key)?;
                Some((cert_pem, key_pem))
            }
            _ => None,
        };
        Ok(TlsMaterial { ca_pem, identity_pem })
    }

    /// A rustls client configuration (ring) for HTTPS.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, OtlpError> {
        let tls = |err: rustls::Error| OtlpError::Tls(err.to_string());
        let mut roots = rustls::RootCertStore::empty();
        match &self.ca_pem {
            Some(pem) => {
                for cert in certificates(pem, Path::new("--otlp-ca"))? {
                    roots.add(cert).map_err(tls)?;
                }
            }
            None => {
                // Roots the system holds that rustls cannot use are skipped, as browsers do.
                let native = rustls_native_certs::load_native_certs();
                roots.add_parsable_certificates(native.certs);
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions().map_err(tls)?.with_root_certificates(roots);
        match &self.identity_pem {
            Some((cert, key)) => {
                let chain = certificates(cert, Path::new("--otlp-cert"))?;
                builder.with_client_auth_cert(chain, private_key(key, Path::new("--otlp-key"))?).map_err(tls)
            }
            None => Ok(builder.with_no_client_auth()),
        }
    }
}

fn read_pem(path: &Path) -> Result<Vec<u8>, OtlpError> {
    let mut pem = Vec::new();
    std::fs::File::open(path)
        .and_then(|file| file.take(MAX_PEM_BYTES).read_to_end(&mut pem))
        .map_err(|cause| OtlpError::Read { path: path.to_path_buf(), cause })?;
    Ok(pem)
}

/// Every certificate of a PEM file; at least one.
fn certificates(pem: &[u8], path: &Path) -> Result<Vec<CertificateDer<'static>>, OtlpError> {
    let bad = |reason: String| OtlpError::Pem { path: path.to_path_buf(), reason };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem).collect::<Result<_, _>>().map_err(|err| bad(err.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in it".into()));
    }
    Ok(certs)
}

fn private_key(pem: &[u8], path: &Path) -> Result<PrivateKeyDer<'static>, OtlpError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|err| OtlpError::Pem { path: path.to_path_buf(), reason: format!("no PEM private key in it ({err})") })
}
