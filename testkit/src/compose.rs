//! Compose files as a shell would expand them with no variable set.

/// `${VAR:-default}` → `default`, `${VAR}` → empty: compose with no such variable set (an
/// unclosed `${` is kept as it is).
pub fn compose_defaults(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let Some(j) = rest[i..].find('}') else {
            out.push_str(&rest[i..]);
            return out;
        };
        let inner = &rest[i + 2..i + j];
        out.push_str(inner.split_once(":-").map(|(_, d)| d).unwrap_or(""));
        rest = &rest[i + j + 1..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_replace_variables() {
        assert_eq!(compose_defaults("a ${X:-8000} b ${Y} c"), "a 8000 b  c");
        assert_eq!(compose_defaults("${P:-/models/m}:x"), "/models/m:x");
        assert_eq!(compose_defaults("plain"), "plain");
        assert_eq!(compose_defaults("open ${X"), "open ${X");
    }
}
