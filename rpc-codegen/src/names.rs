//! The naming rules: how proto service and rpc names become Rust identifiers.
//!
//! Everything here is a pure function of the proto names, so the rules can be
//! checked for collisions before any code is generated.

use heck::{ToSnakeCase, ToUpperCamelCase};

/// Client helper methods that a generated rpc method must not shadow.
///
/// An rpc whose snake-case name is one of these gets the suffix `_rpc`
/// (`rpc Connect` becomes `connect_rpc`), on the client and on the server trait
/// alike, so one rpc has one Rust name everywhere.
pub(crate) const CLIENT_HELPERS: &[&str] = &["new", "connect", "channel"];

/// Makes `ident` a valid Rust identifier: keywords become raw identifiers
/// (`type` -> `r#type`); the keywords that cannot be raw (`self`, `super`,
/// `crate`, `Self`, `extern`, `_`) get a trailing underscore; a leading digit
/// gets a leading underscore.
pub(crate) fn escape(ident: &str) -> String {
    match ident {
        "as" | "break" | "const" | "continue" | "else" | "enum" | "false" | "fn" | "for" | "if"
        | "impl" | "in" | "let" | "loop" | "match" | "mod" | "move" | "mut" | "pub" | "ref"
        | "return" | "static" | "struct" | "trait" | "true" | "type" | "unsafe" | "use"
        | "where" | "while" | "dyn" | "abstract" | "become" | "box" | "do" | "final" | "macro"
        | "override" | "priv" | "typeof" | "unsized" | "virtual" | "yield" | "async" | "await"
        | "try" | "gen" => format!("r#{ident}"),
        "_" | "self" | "super" | "crate" | "Self" | "extern" => format!("{ident}_"),
        _ if ident.starts_with(|c: char| c.is_ascii_digit()) => format!("_{ident}"),
        _ => ident.to_owned(),
    }
}

/// Rust names for one service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServiceNames {
    /// The server trait, `Greeter`.
    pub(crate) server_trait: String,
    /// The client struct, `GreeterClient`.
    pub(crate) client_struct: String,
    /// The server glue struct, `GreeterServer`.
    pub(crate) server_struct: String,
    /// The client module, `greeter_client`.
    pub(crate) client_mod: String,
    /// The server module, `greeter_server`.
    pub(crate) server_mod: String,
    /// The name `Service::name` returns: `helloworld.Greeter`, or `Greeter`
    /// without a package.
    pub(crate) full_name: String,
}

impl ServiceNames {
    pub(crate) fn new(package: &str, proto_name: &str) -> Self {
        let camel = proto_name.to_upper_camel_case();
        let snake = proto_name.to_snake_case();
        let full_name = if package.is_empty() {
            proto_name.to_owned()
        } else {
            format!("{package}.{proto_name}")
        };
        ServiceNames {
            server_trait: escape(&camel),
            client_struct: format!("{camel}Client"),
            server_struct: format!("{camel}Server"),
            client_mod: escape(&format!("{snake}_client")),
            server_mod: escape(&format!("{snake}_server")),
            full_name,
        }
    }
}

/// Rust names for one rpc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MethodNames {
    /// The method on the client and the server trait: `say_hello`, `r#type`,
    /// `self_`, `connect_rpc`.
    pub(crate) method: String,
    /// The associated stream type of a streaming response: `SayHelloStream`.
    pub(crate) stream_type: String,
}

impl MethodNames {
    pub(crate) fn new(proto_name: &str) -> Self {
        let snake = proto_name.to_snake_case();
        let method = if CLIENT_HELPERS.contains(&snake.as_str()) {
            format!("{snake}_rpc")
        } else {
            escape(&snake)
        };
        MethodNames {
            method,
            stream_type: format!("{}Stream", proto_name.to_upper_camel_case()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keywords_become_raw_or_suffixed() {
        assert_eq!(escape("type"), "r#type");
        assert_eq!(escape("async"), "r#async");
        assert_eq!(escape("gen"), "r#gen");
        assert_eq!(escape("self"), "self_");
        assert_eq!(escape("super"), "super_");
        assert_eq!(escape("crate"), "crate_");
        assert_eq!(escape("Self"), "Self_");
        assert_eq!(escape("2fa"), "_2fa");
        assert_eq!(escape("say_hello"), "say_hello");
    }

    #[test]
    fn method_names() {
        let m = MethodNames::new("SayHello");
        assert_eq!(m.method, "say_hello");
        assert_eq!(m.stream_type, "SayHelloStream");

        assert_eq!(MethodNames::new("Type").method, "r#type");
        assert_eq!(MethodNames::new("type").stream_type, "TypeStream");
        assert_eq!(MethodNames::new("Self").method, "self_");
        assert_eq!(MethodNames::new("Drop").method, "drop");
        assert_eq!(MethodNames::new("Clone").method, "clone");
    }

    #[test]
    fn client_helper_names_get_rpc_suffix() {
        assert_eq!(MethodNames::new("New").method, "new_rpc");
        assert_eq!(MethodNames::new("Connect").method, "connect_rpc");
        assert_eq!(MethodNames::new("channel").method, "channel_rpc");
        // Only exact matches are renamed.
        assert_eq!(MethodNames::new("NewThing").method, "new_thing");
    }

    #[test]
    fn service_names() {
        let s = ServiceNames::new("helloworld", "Greeter");
        assert_eq!(s.server_trait, "Greeter");
        assert_eq!(s.client_struct, "GreeterClient");
        assert_eq!(s.server_struct, "GreeterServer");
        assert_eq!(s.client_mod, "greeter_client");
        assert_eq!(s.server_mod, "greeter_server");
        assert_eq!(s.full_name, "helloworld.Greeter");

        let s = ServiceNames::new("", "key_value");
        assert_eq!(s.server_trait, "KeyValue");
        assert_eq!(s.client_mod, "key_value_client");
        assert_eq!(s.full_name, "key_value");

        assert_eq!(ServiceNames::new("p", "Self").server_trait, "Self_");
        assert_eq!(ServiceNames::new("p", "Self").client_struct, "SelfClient");
    }
}
