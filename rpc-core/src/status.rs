//! The outcome of a call: a [`Code`] from gRPC's set and a message.

use std::fmt;

use crate::metadata::MetadataMap;

/// Status codes, numbered as in gRPC so logs and dashboards read the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Code {
    /// Not an error.
    Ok = 0,
    /// The call was cancelled, usually by the caller.
    Cancelled = 1,
    /// An error that fits no other code.
    Unknown = 2,
    /// The client sent an invalid argument.
    InvalidArgument = 3,
    /// The deadline passed before the call completed.
    DeadlineExceeded = 4,
    /// A requested entity was not found.
    NotFound = 5,
    /// The entity the client tried to create already exists.
    AlreadyExists = 6,
    /// The caller may not do this.
    PermissionDenied = 7,
    /// A resource ran out, or a message was larger than allowed.
    ResourceExhausted = 8,
    /// The system is not in a state that allows the operation.
    FailedPrecondition = 9,
    /// The operation was aborted, typically by a concurrency conflict.
    Aborted = 10,
    /// The operation went past the valid range.
    OutOfRange = 11,
    /// The server does not implement the service or method.
    Unimplemented = 12,
    /// An invariant of the system broke (for example: a handler panicked).
    Internal = 13,
    /// The service is unreachable now (for example: the connection failed); retrying may help.
    Unavailable = 14,
    /// Unrecoverable data loss or corruption.
    DataLoss = 15,
    /// The caller has no valid credentials.
    Unauthenticated = 16,
}

impl Code {
    /// The code for a wire value; values outside gRPC's range become [`Code::Unknown`].
    pub fn from_u32(value: u32) -> Code {
        use Code::*;
        match value {
            0 => Ok,
            1 => Cancelled,
            3 => InvalidArgument,
            4 => DeadlineExceeded,
            5 => NotFound,
            6 => AlreadyExists,
            7 => PermissionDenied,
            8 => ResourceExhausted,
            9 => FailedPrecondition,
            10 => Aborted,
            11 => OutOfRange,
            12 => Unimplemented,
            13 => Internal,
            14 => Unavailable,
            15 => DataLoss,
            16 => Unauthenticated,
            _ => Unknown,
        }
    }

    /// The name gRPC uses for this code, e.g. `DEADLINE_EXCEEDED`.
    pub fn as_str(self) -> &'static str {
        use Code::*;
        match self {
            Ok => "OK",
            Cancelled => "CANCELLED",
            Unknown => "UNKNOWN",
            InvalidArgument => "INVALID_ARGUMENT",
            DeadlineExceeded => "DEADLINE_EXCEEDED",
            NotFound => "NOT_FOUND",
            AlreadyExists => "ALREADY_EXISTS",
            PermissionDenied => "PERMISSION_DENIED",
            ResourceExhausted => "RESOURCE_EXHAUSTED",
            FailedPrecondition => "FAILED_PRECONDITION",
            Aborted => "ABORTED",
            OutOfRange => "OUT_OF_RANGE",
            Unimplemented => "UNIMPLEMENTED",
            Internal => "INTERNAL",
            Unavailable => "UNAVAILABLE",
            DataLoss => "DATA_LOSS",
            Unauthenticated => "UNAUTHENTICATED",
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The outcome of a call: a code, a message for humans, and trailing metadata.
///
/// Handlers return `Err(Status)` to fail a call; clients get one back for
/// every failure, local (a deadline, a lost connection) or remote.
#[derive(Clone, PartialEq)]
pub struct Status {
    code: Code,
    message: String,
    metadata: MetadataMap,
}

macro_rules! constructors {
    ($($(#[$doc:meta])* $name:ident => $code:ident,)*) => {
        $(
            $(#[$doc])*
            pub fn $name(message: impl Into<String>) -> Status {
                Status::new(Code::$code, message)
            }
        )*
    };
}

impl Status {
    /// `Ok` with no message nor metadata: what a client's interceptors are
    /// told of a call that succeeded.
    pub(crate) const OK: Status = Status {
        code: Code::Ok,
        message: String::new(),
        metadata: MetadataMap::new(),
    };

    /// A status with `code` and `message`.
    pub fn new(code: Code, message: impl Into<String>) -> Status {
        Status {
            code,
            message: message.into(),
            metadata: MetadataMap::new(),
        }
    }

    constructors! {
        /// [`Code::Ok`] with a message.
        ok => Ok,
        /// [`Code::Cancelled`].
        cancelled => Cancelled,
        /// [`Code::Unknown`].
        unknown => Unknown,
        /// [`Code::InvalidArgument`].
        invalid_argument => InvalidArgument,
        /// [`Code::DeadlineExceeded`].
        deadline_exceeded => DeadlineExceeded,
        /// [`Code::NotFound`].
        not_found => NotFound,
        /// [`Code::AlreadyExists`].
        already_exists => AlreadyExists,
        /// [`Code::PermissionDenied`].
        permission_denied => PermissionDenied,
        /// [`Code::ResourceExhausted`].
        resource_exhausted => ResourceExhausted,
        /// [`Code::FailedPrecondition`].
        failed_precondition => FailedPrecondition,
        /// [`Code::Aborted`].
        aborted => Aborted,
        /// [`Code::OutOfRange`].
        out_of_range => OutOfRange,
        /// [`Code::Unimplemented`].
        unimplemented => Unimplemented,
        /// [`Code::Internal`].
        internal => Internal,
        /// [`Code::Unavailable`].
        unavailable => Unavailable,
        /// [`Code::DataLoss`].
        data_loss => DataLoss,
        /// [`Code::Unauthenticated`].
        unauthenticated => Unauthenticated,
    }

    /// The code.
    pub fn code(&self) -> Code {
        self.code
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Trailing metadata sent with the status.
    pub fn metadata(&self) -> &MetadataMap {
        &self.metadata
    }

    /// Trailing metadata, to add to before returning the status.
    pub fn metadata_mut(&mut self) -> &mut MetadataMap {
        &mut self.metadata
    }

    /// Whether the code is [`Code::Ok`].
    pub fn is_ok(&self) -> bool {
        self.code == Code::Ok
    }

    /// A status of its parts, as a frame carries them (no empty map made
    /// and dropped on the way, as `new` then setting the metadata would).
    pub(crate) fn from_parts(code: Code, message: String, metadata: MetadataMap) -> Status {
        Status {
            code,
            message,
            metadata,
        }
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Status");
        d.field("code", &self.code).field("message", &self.message);
        if !self.metadata.is_empty() {
            d.field("metadata", &self.metadata);
        }
        d.finish()
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for Status {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_through_their_wire_values() {
        for value in 0..=16 {
            assert_eq!(Code::from_u32(value) as u32, value);
        }
        assert_eq!(Code::from_u32(17), Code::Unknown);
        assert_eq!(Code::from_u32(u32::MAX), Code::Unknown);
    }

    #[test]
    fn display_names_code_and_message() {
        let status = Status::deadline_exceeded("after 5 ms");
        assert_eq!(status.to_string(), "DEADLINE_EXCEEDED: after 5 ms");
    }
}
