//! The authenticated handshake: a client proves it holds the listener's
//! shared secret, and the server proves it back, within the connection
//! manager's private data, before the server allocates anything.
//!
//! RDMA has no TLS: the connection manager's messages and the data are
//! not encrypted. What this guards against is a client that does not hold
//! the secret getting a connection (and so any handler to run), and a
//! client being served by an endpoint that does not hold it. It is a
//! challenge–response, so a recorded exchange cannot be replayed:
//!
//! 1. The client connects with its [`Hello`](super::Hello) and no proof.
//!    The listener rejects it with a [`Challenge`] (in a
//!    [`Refused::Challenge`](super::Refused::Challenge)): when it was issued,
//!    a random nonce, and a tag binding both to the client's address under
//!    a key only the listener knows. The listener keeps no state for it.
//! 2. The client connects again (a new connection manager id), its hello
//!    flagged [`FLAG_PROOF`], followed by the challenge and
//!    [`client_proof`]: HMAC-SHA256 of the challenge and the hello under
//!    the secret. The listener checks the tag (it issued this challenge, to
//!    this address), its age (at most [`Gate::WINDOW`]), the proof, and
//!    that the nonce was not used before (each challenge admits one
//!    connection); only then does it allocate and accept.
//! 3. Its accept carries [`server_proof`]: HMAC of the challenge, the
//!    client's proof and the server's hello, which the client checks
//!    before using the connection.
//!
//! Not covered: an attacker on the path who can rewrite packets can take
//! over a connection after its set-up, and read or change what it
//! carries (as with any unencrypted transport); the secret is only as
//! safe as the files and hosts that hold it.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::IpAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::hello::HELLO_LEN;

type HmacSha256 = Hmac<Sha256>;

/// The identity a connection reports for a peer that proved the shared
/// secret (`Peer::identity` in rpc-core, [`RdmaStream::peer_identity`]).
///
/// [`RdmaStream::peer_identity`]: crate::RdmaStream::peer_identity
pub const PROVEN_IDENTITY: &str = "rdma-secret";

/// Set in a hello's flags (bytes 6..8) when a proof follows it: the
/// client's challenge and [`client_proof`], or the server's
/// [`server_proof`].
pub const FLAG_PROOF: u16 = 1;
/// Encoded length of a [`Challenge`].
pub const CHALLENGE_LEN: usize = 16;
/// Length of the client's proof (a truncated HMAC-SHA256).
pub const CLIENT_PROOF_LEN: usize = 8;
/// Length of the server's proof (a truncated HMAC-SHA256).
pub const SERVER_PROOF_LEN: usize = 16;
/// A client's connect data with its proof: 56 bytes, the most a connect
/// request carries.
pub const PROVEN_REQUEST_LEN: usize = HELLO_LEN + CHALLENGE_LEN + CLIENT_PROOF_LEN;
/// A server's accept data with its proof.
pub const PROVEN_REPLY_LEN: usize = HELLO_LEN + SERVER_PROOF_LEN;
/// Fewest bytes a [`SharedSecret`] has.
pub const MIN_SECRET_LEN: usize = 16;

/// A secret shared by the endpoints that may connect to each other.
///
/// Its bytes never appear in `Debug` output or on the wire.
#[derive(Clone)]
pub struct SharedSecret(Box<[u8]>);

impl SharedSecret {
    /// A secret of at least [`MIN_SECRET_LEN`] bytes (use random bytes,
    /// e.g. `head -c 32 /dev/urandom | base64`).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<SharedSecret, SecretError> {
        let bytes = bytes.into();
        if bytes.len() < MIN_SECRET_LEN {
            return Err(SecretError::TooShort { len: bytes.len() });
        }
        Ok(SharedSecret(bytes.into_boxed_slice()))
    }

    /// The secret in `path`: its bytes, without trailing white space (a
    /// file written by `echo` ends in a newline).
    pub fn from_file(path: impl AsRef<Path>) -> Result<SharedSecret, SecretError> {
        let path = path.as_ref();
        let mut bytes = std::fs::read(path).map_err(|source| SecretError::Read {
            path: path.display().to_string(),
            source,
        })?;
        while bytes.last().is_some_and(u8::is_ascii_whitespace) {
            bytes.pop();
        }
        SharedSecret::new(bytes).map_err(|e| SecretError::InFile {
            path: path.display().to_string(),
            error: Box::new(e),
        })
    }

    fn mac(&self, label: &[u8]) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(label);
        mac
    }
}

impl fmt::Debug for SharedSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SharedSecret({} bytes)", self.0.len())
    }
}

/// Why a [`SharedSecret`] could not be made.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    /// Fewer than [`MIN_SECRET_LEN`] bytes.
    #[error("a shared secret needs at least {MIN_SECRET_LEN} bytes, this one has {len}")]
    TooShort {
        /// Its length.
        len: usize,
    },
    /// The file could not be read.
    #[error("reading the shared secret from {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file's contents are not a usable secret.
    #[error("the shared secret in {path}: {error}")]
    InFile {
        /// The file.
        path: String,
        /// Why.
        error: Box<SecretError>,
    },
}

/// What a listener sends a client to prove the secret against: when it
/// was issued (seconds on the listener's clock), a random nonce, and a tag
/// binding both to the client's address.
///
/// Layout (little-endian): `issued_at: u32, nonce: u64, tag: [u8; 4]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Challenge(pub [u8; CHALLENGE_LEN]);

impl Challenge {
    fn issued_at(&self) -> u32 {
        u32::from_le_bytes(self.0[0..4].try_into().expect("4 bytes"))
    }

    fn nonce(&self) -> u64 {
        u64::from_le_bytes(self.0[4..12].try_into().expect("8 bytes"))
    }
}

/// The client's proof for `challenge`, sent with `hello` (its encoded
/// hello, flags included).
pub fn client_proof(
    secret: &SharedSecret,
    challenge: &Challenge,
    hello: &[u8; HELLO_LEN],
) -> [u8; CLIENT_PROOF_LEN] {
    let mut mac = secret.mac(b"rdma-rpc v1 client proof");
    mac.update(&challenge.0);
    mac.update(hello);
    truncate(mac)
}

/// The server's proof, sent with its hello `hello` in reply to a client
/// that proved `client_proof` for `challenge`.
pub fn server_proof(
    secret: &SharedSecret,
    challenge: &Challenge,
    client_proof: &[u8; CLIENT_PROOF_LEN],
    hello: &[u8; HELLO_LEN],
) -> [u8; SERVER_PROOF_LEN] {
    let mut mac = secret.mac(b"rdma-rpc v1 server proof");
    mac.update(&challenge.0);
    mac.update(client_proof);
    mac.update(hello);
    truncate(mac)
}

fn truncate<const N: usize>(mac: HmacSha256) -> [u8; N] {
    mac.finalize().into_bytes()[..N]
        .try_into()
        .expect("HMAC-SHA256 is 32 bytes")
}

/// Compares in time that does not depend on where they differ.
fn same<const N: usize>(a: &[u8; N], b: &[u8; N]) -> bool {
    a.iter().zip(b).fold(0, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The hello's flags.
pub fn flags(private_data: &[u8]) -> u16 {
    private_data
        .get(6..8)
        .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]))
}

/// Sets `flag` in an encoded hello.
pub fn set_flag(hello: &mut [u8; HELLO_LEN], flag: u16) {
    let flags = flags(hello) | flag;
    hello[6..8].copy_from_slice(&flags.to_le_bytes());
}

/// A client's connect data: `hello` (flagged [`FLAG_PROOF`] here), the
/// challenge, and the proof for both.
pub fn proven_request(
    secret: &SharedSecret,
    mut hello: [u8; HELLO_LEN],
    challenge: &Challenge,
) -> [u8; PROVEN_REQUEST_LEN] {
    set_flag(&mut hello, FLAG_PROOF);
    let proof = client_proof(secret, challenge, &hello);
    let mut b = [0; PROVEN_REQUEST_LEN];
    b[..HELLO_LEN].copy_from_slice(&hello);
    b[HELLO_LEN..HELLO_LEN + CHALLENGE_LEN].copy_from_slice(&challenge.0);
    b[HELLO_LEN + CHALLENGE_LEN..].copy_from_slice(&proof);
    b
}

/// Checks the server's accept data against the request this side sent;
/// `Err` says what is wrong.
pub fn check_reply(
    secret: &SharedSecret,
    request: &[u8; PROVEN_REQUEST_LEN],
    reply: &[u8],
) -> Result<(), &'static str> {
    if flags(reply) & FLAG_PROOF == 0 || reply.len() < PROVEN_REPLY_LEN {
        return Err(UNPROVEN_SERVER);
    }
    let (challenge, proof) = split_request(request);
    let hello: &[u8; HELLO_LEN] = reply[..HELLO_LEN].try_into().expect("checked length");
    let got: &[u8; SERVER_PROOF_LEN] = reply[HELLO_LEN..PROVEN_REPLY_LEN]
        .try_into()
        .expect("checked length");
    if same(&server_proof(secret, &challenge, &proof, hello), got) {
        Ok(())
    } else {
        Err("the server's proof of the shared secret is wrong (it holds another secret)")
    }
}

/// Why a client with a secret refuses a server that accepted it without
/// proving the secret.
pub const UNPROVEN_SERVER: &str = "the server accepted without proving the shared secret \
    (it does not authenticate clients: configure the same secret on both sides)";

fn split_request(b: &[u8; PROVEN_REQUEST_LEN]) -> (Challenge, [u8; CLIENT_PROOF_LEN]) {
    let challenge = Challenge(
        b[HELLO_LEN..HELLO_LEN + CHALLENGE_LEN]
            .try_into()
            .expect("16 bytes"),
    );
    let proof = b[HELLO_LEN + CHALLENGE_LEN..].try_into().expect("8 bytes");
    (challenge, proof)
}

/// Why a [`Gate`] refused a client's proof.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProofRefused {
    /// The proof does not match the secret (the client holds another one).
    WrongProof,
    /// The challenge is older than [`Gate::WINDOW`], or from the future.
    Stale,
    /// This challenge already admitted a connection.
    Replayed,
    /// This listener did not issue the challenge to this address.
    Forged,
    /// The proof is missing or cut short.
    Malformed,
    /// Too many proofs were used within the window to remember them all.
    Busy,
}

impl ProofRefused {
    /// The code sent to the client.
    pub fn code(self) -> u64 {
        self as u64 + 1
    }

    /// The reason of [`code`](ProofRefused::code).
    pub fn from_code(code: u64) -> Option<ProofRefused> {
        use ProofRefused::*;
        [WrongProof, Stale, Replayed, Forged, Malformed, Busy]
            .into_iter()
            .find(|r| r.code() == code)
    }
}

impl fmt::Display for ProofRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProofRefused::WrongProof => "wrong proof of the shared secret (another secret)",
            ProofRefused::Stale => "the challenge expired before it was answered",
            ProofRefused::Replayed => "the answer to this challenge was used before (a replay)",
            ProofRefused::Forged => "the challenge was not issued to this address by this server",
            ProofRefused::Malformed => "the proof is missing or cut short",
            ProofRefused::Busy => "too many connections proved the secret lately; try again",
        })
    }
}

/// A client's proof a [`Gate`] accepted: what the server's reply proves
/// in turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proven {
    challenge: Challenge,
    proof: [u8; CLIENT_PROOF_LEN],
}

impl Proven {
    /// The server's accept data: its `hello` flagged [`FLAG_PROOF`], then
    /// its [`server_proof`].
    pub fn reply(
        &self,
        secret: &SharedSecret,
        mut hello: [u8; HELLO_LEN],
    ) -> [u8; PROVEN_REPLY_LEN] {
        set_flag(&mut hello, FLAG_PROOF);
        let mut reply = [0; PROVEN_REPLY_LEN];
        reply[..HELLO_LEN].copy_from_slice(&hello);
        reply[HELLO_LEN..].copy_from_slice(&server_proof(
            secret,
            &self.challenge,
            &self.proof,
            &hello,
        ));
        reply
    }
}

/// A listener's side of the handshake: issues challenges and checks
/// proofs. Holds no state per challenge issued, only the nonces of
/// challenges that admitted a connection within the window (so each admits
/// one), at most [`Gate::MAX_REMEMBERED`].
pub struct Gate {
    secret: SharedSecret,
    /// Keys the challenges' tags; never leaves the listener.
    key: [u8; 32],
    epoch: Instant,
    /// Challenges issued (their nonces' source).
    issued: u64,
    used: HashMap<u64, u32>,
    used_order: VecDeque<u64>,
}

impl fmt::Debug for Gate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gate")
            .field("secret", &self.secret)
            .field("used", &self.used.len())
            .finish_non_exhaustive()
    }
}

impl Gate {
    /// How long a challenge may be answered.
    pub const WINDOW: Duration = Duration::from_secs(30);
    /// Most used challenges remembered (connections admitted within
    /// [`Gate::WINDOW`]); past it, proofs are refused as
    /// [`ProofRefused::Busy`].
    pub const MAX_REMEMBERED: usize = 1 << 16;

    /// A gate for `secret`, its tag key from the system's random source.
    pub fn new(secret: SharedSecret, now: Instant) -> std::io::Result<Gate> {
        let mut key = [0; 32];
        getrandom::fill(&mut key).map_err(std::io::Error::other)?;
        Ok(Gate {
            secret,
            key,
            epoch: now,
            issued: 0,
            used: HashMap::new(),
            used_order: VecDeque::new(),
        })
    }

    fn seconds(&self, now: Instant) -> u32 {
        u32::try_from(now.saturating_duration_since(self.epoch).as_secs()).unwrap_or(u32::MAX)
    }

    fn tag(&self, issued_at: u32, nonce: u64, peer: IpAddr) -> [u8; 4] {
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("any key length");
        mac.update(&issued_at.to_le_bytes());
        mac.update(&nonce.to_le_bytes());
        match peer {
            IpAddr::V4(ip) => mac.update(&ip.octets()),
            IpAddr::V6(ip) => mac.update(&ip.octets()),
        }
        truncate(mac)
    }

    /// A fresh challenge for a client at `peer`.
    pub fn challenge(&mut self, peer: IpAddr, now: Instant) -> Challenge {
        // Unique per challenge and unpredictable without the key.
        self.issued += 1;
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("any key length");
        mac.update(b"nonce");
        mac.update(&self.issued.to_le_bytes());
        let nonce = u64::from_le_bytes(truncate(mac));
        let issued_at = self.seconds(now);
        let mut b = [0; CHALLENGE_LEN];
        b[0..4].copy_from_slice(&issued_at.to_le_bytes());
        b[4..12].copy_from_slice(&nonce.to_le_bytes());
        b[12..16].copy_from_slice(&self.tag(issued_at, nonce, peer));
        Challenge(b)
    }

    /// Checks the connect data of a client at `peer` that flagged a proof;
    /// on success the challenge is spent, and what the reply needs is
    /// returned.
    pub fn check(
        &mut self,
        private_data: &[u8],
        peer: IpAddr,
        now: Instant,
    ) -> Result<Proven, ProofRefused> {
        let request: &[u8; PROVEN_REQUEST_LEN] = private_data
            .get(..PROVEN_REQUEST_LEN)
            .and_then(|b| b.try_into().ok())
            .ok_or(ProofRefused::Malformed)?;
        let (challenge, proof) = split_request(request);
        let (issued_at, nonce) = (challenge.issued_at(), challenge.nonce());
        let tag: &[u8; 4] = challenge.0[12..16].try_into().expect("4 bytes");
        if !same(&self.tag(issued_at, nonce, peer), tag) {
            return Err(ProofRefused::Forged);
        }
        let now_s = self.seconds(now);
        if issued_at > now_s || now_s - issued_at > Self::WINDOW.as_secs() as u32 {
            return Err(ProofRefused::Stale);
        }
        let their_hello: &[u8; HELLO_LEN] = request[..HELLO_LEN].try_into().expect("32 bytes");
        if !same(&client_proof(&self.secret, &challenge, their_hello), &proof) {
            return Err(ProofRefused::WrongProof);
        }
        self.forget_expired(now_s);
        if self.used.contains_key(&nonce) {
            return Err(ProofRefused::Replayed);
        }
        if self.used.len() >= Self::MAX_REMEMBERED {
            return Err(ProofRefused::Busy);
        }
        self.used.insert(nonce, issued_at);
        self.used_order.push_back(nonce);
        Ok(Proven { challenge, proof })
    }

    /// Forgets used challenges that expired (in the order they were used:
    /// one that was answered late may stay a little longer than needed).
    fn forget_expired(&mut self, now_s: u32) {
        let window = Self::WINDOW.as_secs() as u32;
        while let Some(&nonce) = self.used_order.front() {
            let issued_at = self.used[&nonce];
            if now_s.saturating_sub(issued_at) <= window {
                break;
            }
            self.used_order.pop_front();
            self.used.remove(&nonce);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    const CLIENT: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 77, 0, 2));

    fn secret(s: &str) -> SharedSecret {
        SharedSecret::new(s).unwrap()
    }

    fn hello(byte: u8) -> [u8; HELLO_LEN] {
        [byte; HELLO_LEN]
    }

    #[test]
    fn a_client_holding_the_secret_is_admitted_once_per_challenge_and_checks_the_server() {
        let t0 = Instant::now();
        let mut gate = Gate::new(secret("sixteen byte key"), t0).unwrap();
        let challenge = gate.challenge(CLIENT, t0);
        let request = proven_request(&secret("sixteen byte key"), hello(1), &challenge);
        assert_eq!(flags(&request) & FLAG_PROOF, FLAG_PROOF);
        let proven = gate.check(&request, CLIENT, t0).expect("admitted");
        let reply = proven.reply(&secret("sixteen byte key"), hello(2));
        check_reply(&secret("sixteen byte key"), &request, &reply).expect("server proved");
        // The server's proof is bound to the secret, this request and its hello.
        let err = check_reply(&secret("another long key"), &request, &reply).unwrap_err();
        assert!(err.contains("wrong"), "{err}");
        let mut forged = reply;
        forged[10] ^= 1;
        assert!(check_reply(&secret("sixteen byte key"), &request, &forged).is_err());
        // The same answer again: a replay.
        assert_eq!(
            gate.check(&request, CLIENT, t0),
            Err(ProofRefused::Replayed)
        );
        // A new challenge admits again.
        let again = gate.challenge(CLIENT, t0);
        assert_ne!(again, challenge);
        let request = proven_request(&secret("sixteen byte key"), hello(1), &again);
        assert!(gate.check(&request, CLIENT, t0).is_ok());
    }

    #[test]
    fn wrong_stale_forged_and_short_proofs_are_refused() {
        let t0 = Instant::now();
        let mut gate = Gate::new(secret("sixteen byte key"), t0).unwrap();
        let challenge = gate.challenge(CLIENT, t0);
        let wrong = proven_request(&secret("another long key"), hello(1), &challenge);
        assert_eq!(
            gate.check(&wrong, CLIENT, t0),
            Err(ProofRefused::WrongProof)
        );
        let good = proven_request(&secret("sixteen byte key"), hello(1), &challenge);
        // From another address than the challenge was issued to.
        let other = IpAddr::V4(Ipv4Addr::new(10, 77, 0, 3));
        assert_eq!(gate.check(&good, other, t0), Err(ProofRefused::Forged));
        // A challenge this listener did not issue (another gate's key).
        let foreign = Gate::new(secret("sixteen byte key"), t0)
            .unwrap()
            .challenge(CLIENT, t0);
        let request = proven_request(&secret("sixteen byte key"), hello(1), &foreign);
        assert_eq!(gate.check(&request, CLIENT, t0), Err(ProofRefused::Forged));
        // The hello is covered by the proof.
        let mut tampered = good;
        tampered[8] ^= 1;
        assert_eq!(
            gate.check(&tampered, CLIENT, t0),
            Err(ProofRefused::WrongProof)
        );
        assert_eq!(
            gate.check(&good[..40], CLIENT, t0),
            Err(ProofRefused::Malformed)
        );
        // Answered too late.
        let late = t0 + Gate::WINDOW + Duration::from_secs(2);
        assert_eq!(gate.check(&good, CLIENT, late), Err(ProofRefused::Stale));
        // In time, it still works (none of the refusals spent it).
        assert!(gate
            .check(&good, CLIENT, t0 + Duration::from_secs(5))
            .is_ok());
    }

    #[test]
    fn used_challenges_are_forgotten_after_the_window_and_bounded() {
        let t0 = Instant::now();
        let key = secret("sixteen byte key");
        let mut gate = Gate::new(key.clone(), t0).unwrap();
        for _ in 0..10 {
            let c = gate.challenge(CLIENT, t0);
            gate.check(&proven_request(&key, hello(1), &c), CLIENT, t0)
                .unwrap();
        }
        assert_eq!(gate.used.len(), 10);
        let later = t0 + Gate::WINDOW + Duration::from_secs(2);
        let c = gate.challenge(CLIENT, later);
        gate.check(&proven_request(&key, hello(1), &c), CLIENT, later)
            .unwrap();
        assert_eq!(gate.used.len(), 1, "the expired ones were forgotten");
        assert_eq!(gate.used_order.len(), 1);
    }

    #[test]
    fn secrets_are_long_enough_and_read_from_files_without_the_newline() {
        assert!(matches!(
            SharedSecret::new("short"),
            Err(SecretError::TooShort { len: 5 })
        ));
        let dir = std::env::temp_dir().join(format!("rdma-secret-{}", std::process::id()));
        std::fs::write(&dir, "sixteen byte key\n").unwrap();
        let from_file = SharedSecret::from_file(&dir).unwrap();
        assert_eq!(&*from_file.0, b"sixteen byte key");
        assert_eq!(format!("{from_file:?}"), "SharedSecret(16 bytes)");
        std::fs::write(&dir, "short\n").unwrap();
        let err = SharedSecret::from_file(&dir).unwrap_err().to_string();
        assert!(
            err.contains(&dir.display().to_string()) && err.contains("16 bytes"),
            "{err}"
        );
        std::fs::remove_file(&dir).unwrap();
        let err = SharedSecret::from_file(&dir).unwrap_err().to_string();
        assert!(err.contains("reading the shared secret from"), "{err}");
    }

    #[test]
    fn refusal_codes_round_trip() {
        for r in [
            ProofRefused::WrongProof,
            ProofRefused::Stale,
            ProofRefused::Replayed,
            ProofRefused::Forged,
            ProofRefused::Malformed,
            ProofRefused::Busy,
        ] {
            assert_eq!(ProofRefused::from_code(r.code()), Some(r));
        }
        assert_eq!(ProofRefused::from_code(0), None);
    }
}
