//! A cluster's certificates: one CA, and one certificate per process (router and nodes)
//! that serves as both its server and its client identity. Every certificate names the
//! cluster's fixed server name, so nodes may be addressed by any IP or host name.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use crate::tls::SERVER_NAME;

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("generating certificates: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("writing {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
}

/// PEM text of one identity.
#[derive(Debug, Clone)]
pub struct IdentityPem {
    pub cert: String,
    pub key: String,
}

/// A throwaway certificate authority and identities signed by it.
pub struct ClusterCa {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

impl ClusterCa {
    pub fn generate(name: &str) -> Result<Self, CertError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key)?;
        Ok(Self {
            pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA certificate every process trusts.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A node's identity: server and client authentication, valid for the cluster's
    /// server name, `localhost` and the loopback addresses.
    pub fn identity(&self, name: &str) -> Result<IdentityPem, CertError> {
        let key = KeyPair::generate()?;
        let mut params =
            CertificateParams::new(vec![SERVER_NAME.to_owned(), "localhost".to_owned()])?;
        params
            .subject_alt_names
            .push(SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()));
        params
            .subject_alt_names
            .push(SanType::IpAddress(std::net::Ipv6Addr::LOCALHOST.into()));
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(IdentityPem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }
}

/// Writes `ca.pem` and `NAME.pem` / `NAME.key` for each name into `dir`; returns the
/// paths written.
pub fn write_cluster(dir: &Path, names: &[String]) -> Result<Vec<PathBuf>, CertError> {
    let write = |path: PathBuf, text: &str| -> Result<PathBuf, CertError> {
        std::fs::write(&path, text).map_err(|source| CertError::Write {
            path: path.display().to_string(),
            source,
        })?;
        Ok(path)
    };
    std::fs::create_dir_all(dir).map_err(|source| CertError::Write {
        path: dir.display().to_string(),
        source,
    })?;
    let ca = ClusterCa::generate("kvwarden cluster CA")?;
    let mut written = vec![write(dir.join("ca.pem"), ca.pem())?];
    for name in names {
        let id = ca.identity(name)?;
        written.push(write(dir.join(format!("{name}.pem")), &id.cert)?);
        let key = write(dir.join(format!("{name}.key")), &id.key)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600));
        }
        written.push(key);
    }
    Ok(written)
}
