//! Validation of a Kubernetes object against a CRD's `openAPIV3Schema`, the way the API server
//! does it: structural defaulting first, then the OpenAPI value validations, then the
//! `x-kubernetes-validations` (CEL) rules, and the errors worded as the API server words them
//! (`spec.targetPorts: Too many: 9: must have at most 8 items`).
//!
//! The validator walks a schema given as JSON (the CRD's `openAPIV3Schema`, as parsed from its
//! YAML). It covers the OpenAPI subset structural schemas use: `type` (and
//! `x-kubernetes-int-or-string`, `nullable`), `properties`, `required`, `additionalProperties`,
//! `x-kubernetes-preserve-unknown-fields`, `items`, `enum`, `minimum`/`maximum` (and their
//! exclusive forms), `multipleOf`, `minLength`/`maxLength`, `pattern`, `format`,
//! `minItems`/`maxItems`, `uniqueItems`, `minProperties`/`maxProperties`,
//! `x-kubernetes-list-type` (`set`, `map` with `x-kubernetes-list-map-keys`), `allOf`,
//! `anyOf`, `oneOf`, `not` and `default`. Fields the schema does not know are reported the way
//! `kubectl apply` (strict field validation) reports them.
//!
//! CEL is not interpreted: a caller passes a [`CelRules`] implementation that knows the rules
//! of one CRD by their exact text. An unknown rule is reported (or counted, for callers that
//! only want the structural part), never silently passed.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

pub use regex_lite::Regex;
use serde_json::{Map, Value};

/// The compiled form of a CRD `pattern`, compiled once per process and shared.
///
/// Kubernetes checks `pattern` with Go's RE2 `regexp.MatchString`: an unanchored search with
/// ASCII-only `\d \w \s` and `.` not matching `\n`. `regex-lite` has the same syntax and
/// classes and matches in linear time. A pattern it cannot compile (e.g. look-around, which RE2
/// refuses too) is an error the validator reports as an unsupported rule, not a silent pass.
pub fn pattern(source: &str) -> Result<Arc<Regex>, String> {
    type Compiled = HashMap<String, Result<Arc<Regex>, String>>;
    static COMPILED: OnceLock<Mutex<Compiled>> = OnceLock::new();
    let mut compiled = COMPILED
        .get_or_init(Default::default)
        .lock()
        // A panic elsewhere while holding the lock leaves a map that is still consistent.
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    compiled
        .entry(source.to_string())
        .or_insert_with(|| {
            Regex::new(source)
                .map(Arc::new)
                .map_err(|e| format!("pattern {source:?}: {e}"))
        })
        .clone()
}

/// A field path as the API server prints it: `spec.targetPorts[0].number`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FieldPath(String);

impl FieldPath {
    pub fn root() -> FieldPath {
        FieldPath(String::new())
    }

    pub fn child(&self, name: &str) -> FieldPath {
        if self.0.is_empty() {
            FieldPath(name.to_string())
        } else {
            FieldPath(format!("{}.{}", self.0, name))
        }
    }

    pub fn index(&self, i: usize) -> FieldPath {
        FieldPath(format!("{}[{}]", self.0, i))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The root itself prints as `<root>` in the API server's messages.
    fn display_name(&self) -> &str {
        if self.0.is_empty() {
            "<root>"
        } else {
            &self.0
        }
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.display_name())
    }
}

/// One field error, as `k8s.io/apimachinery/pkg/util/validation/field` models it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: FieldPath,
    pub kind: ErrorKind,
}

/// The error types the API server's CRD validation produces. `value` strings are already
/// printed the way Go prints them (`%q` for strings, `%v` for numbers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorKind {
    /// `Required value` (with an optional detail).
    Required { detail: String },
    /// `Invalid value: <value>: <detail>`.
    Invalid { value: String, detail: String },
    /// `Unsupported value: <value>: supported values: "a", "b"`.
    NotSupported {
        value: String,
        supported: Vec<String>,
    },
    /// `Too long: may not be more than <max> bytes`.
    TooLong { max: usize },
    /// `Too many: <actual>: must have at most <max> items`.
    TooMany { actual: usize, max: usize },
    /// `Duplicate value: <value>`.
    Duplicate { value: String },
    /// A field the schema does not define (what `kubectl apply`'s strict validation reports).
    UnknownField,
    /// A CEL rule this validator cannot evaluate.
    UnsupportedRule { rule: String },
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let field = &self.field;
        match &self.kind {
            ErrorKind::Required { detail } if detail.is_empty() => {
                write!(f, "{field}: Required value")
            }
            ErrorKind::Required { detail } => write!(f, "{field}: Required value: {detail}"),
            ErrorKind::Invalid { value, detail } => {
                write!(f, "{field}: Invalid value: {value}: {detail}")
            }
            ErrorKind::NotSupported { value, supported } => {
                let quoted: Vec<String> = supported.iter().map(|s| go_quote(s)).collect();
                write!(
                    f,
                    "{field}: Unsupported value: {value}: supported values: {}",
                    quoted.join(", ")
                )
            }
            ErrorKind::TooLong { max } => {
                let unit = if *max == 1 { "byte" } else { "bytes" };
                write!(f, "{field}: Too long: may not be more than {max} {unit}")
            }
            ErrorKind::TooMany { actual, max } => {
                let unit = if *max == 1 { "item" } else { "items" };
                write!(
                    f,
                    "{field}: Too many: {actual}: must have at most {max} {unit}"
                )
            }
            ErrorKind::Duplicate { value } => write!(f, "{field}: Duplicate value: {value}"),
            ErrorKind::UnknownField => write!(f, "unknown field \"{}\"", field.as_str()),
            ErrorKind::UnsupportedRule { rule } => write!(
                f,
                "{field}: Internal error: CEL rule {rule:?} is not supported by this validator"
            ),
        }
    }
}

impl std::error::Error for FieldError {}

/// Evaluates the `x-kubernetes-validations` rules of one CRD.
pub trait CelRules {
    /// `Some(true)` when `self_value` satisfies `rule`, `Some(false)` when it violates it,
    /// `None` when the rule is unknown to this implementation.
    fn eval(&self, rule: &str, self_value: &Value) -> Option<bool>;
}

/// Knows no rule at all.
pub struct NoCel;

impl CelRules for NoCel {
    fn eval(&self, _rule: &str, _self_value: &Value) -> Option<bool> {
        None
    }
}

/// What to do with a rule [`CelRules::eval`] does not know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownRules {
    /// Report an [`ErrorKind::UnsupportedRule`] error.
    Fail,
    /// Count it in [`Report::skipped_rules`] and go on.
    Skip,
}

/// The outcome of [`validate`].
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub errors: Vec<FieldError>,
    /// Rules that were not evaluated (only with [`UnknownRules::Skip`]).
    pub skipped_rules: Vec<(FieldPath, String)>,
}

/// Applies the schema's defaults, then validates. Returns the defaulted object (what the API
/// server would store) and the report.
pub fn validate(
    schema: &Value,
    object: &Value,
    cel: &dyn CelRules,
    unknown_rules: UnknownRules,
) -> (Value, Report) {
    let mut defaulted = object.clone();
    apply_defaults(schema, &mut defaulted);
    let mut v = Validator {
        cel,
        unknown_rules,
        report: Report::default(),
    };
    v.check(schema, &defaulted, &FieldPath::root(), true);
    v.cel_pass(schema, &defaulted, &FieldPath::root());
    (defaulted, v.report)
}

/// Structural defaulting: a property absent from an object (or null and not nullable) takes
/// the schema's `default`; then the defaults of what is inside apply.
pub fn apply_defaults(schema: &Value, value: &mut Value) {
    match value {
        Value::Object(map) => {
            if let Some(props) = schema.get("properties").and_then(Value::as_object) {
                for (name, prop) in props {
                    let Some(default) = prop.get("default") else {
                        continue;
                    };
                    let nullable = prop.get("nullable").and_then(Value::as_bool) == Some(true);
                    match map.get(name) {
                        None => {
                            map.insert(name.clone(), default.clone());
                        }
                        Some(Value::Null) if !nullable => {
                            map.insert(name.clone(), default.clone());
                        }
                        Some(_) => {}
                    }
                }
                for (name, child) in map.iter_mut() {
                    if let Some(prop) = props.get(name) {
                        apply_defaults(prop, child);
                    }
                }
            }
            if let Some(additional) = schema.get("additionalProperties") {
                if additional.is_object() {
                    let known = schema.get("properties").and_then(Value::as_object);
                    for (name, child) in map.iter_mut() {
                        if !known.is_some_and(|k| k.contains_key(name)) {
                            apply_defaults(additional, child);
                        }
                    }
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for item in items {
                    apply_defaults(item_schema, item);
                }
            }
        }
        _ => {}
    }
}

struct Validator<'a> {
    cel: &'a dyn CelRules,
    unknown_rules: UnknownRules,
    report: Report,
}

/// The OpenAPI type name of a JSON value, as go-openapi reports it.
fn json_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if is_integer(n) => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn is_integer(n: &serde_json::Number) -> bool {
    n.is_i64()
        || n.is_u64()
        || n.as_f64()
            .is_some_and(|f| f.fract() == 0.0 && f.is_finite())
}

fn type_matches(expected: &str, value: &Value) -> bool {
    match (expected, value) {
        ("object", Value::Object(_)) => true,
        ("array", Value::Array(_)) => true,
        ("string", Value::String(_)) => true,
        ("boolean", Value::Bool(_)) => true,
        ("number", Value::Number(_)) => true,
        ("integer", Value::Number(n)) => is_integer(n),
        _ => false,
    }
}

/// Go's `strconv.Quote`.
pub fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\x07' => out.push_str("\\a"),
            '\x08' => out.push_str("\\b"),
            '\x0c' => out.push_str("\\f"),
            '\x0b' => out.push_str("\\v"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c if c.is_control() => {
                let n = c as u32;
                if n <= 0xffff {
                    out.push_str(&format!("\\u{n:04x}"));
                } else {
                    out.push_str(&format!("\\U{n:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A JSON value printed the way the API server prints a bad value.
pub fn go_value(value: &Value) -> String {
    match value {
        Value::String(s) => go_quote(s),
        Value::Number(n) => go_number(n),
        Value::Bool(b) => b.to_string(),
        Value::Null => "\"null\"".into(),
        other => other.to_string(),
    }
}

fn go_number(n: &serde_json::Number) -> String {
    if let Some(i) = n.as_i64() {
        return i.to_string();
    }
    if let Some(u) = n.as_u64() {
        return u.to_string();
    }
    n.as_f64().map(go_float).unwrap_or_else(|| n.to_string())
}

/// Go's `%v` for a float64 (`strconv.FormatFloat(f, 'g', -1, 64)` with Go's exponent form).
fn go_float(f: f64) -> String {
    if f.fract() == 0.0 && f.abs() < 1e21 {
        return format!("{f:.0}");
    }
    let s = format!("{f}");
    if f.abs() >= 1e21 || (f != 0.0 && f.abs() < 1e-4) {
        let e = format!("{f:e}");
        if let Some((mantissa, exp)) = e.split_once('e') {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', exp),
            };
            return format!("{mantissa}e{sign}{digits:0>2}");
        }
    }
    s
}

fn schema_number(schema: &Value, key: &str) -> Option<f64> {
    schema.get(key).and_then(Value::as_f64)
}

fn schema_usize(schema: &Value, key: &str) -> Option<usize> {
    schema
        .get(key)
        .and_then(Value::as_u64)
        .and_then(|n| usize::try_from(n).ok())
}

impl Validator<'_> {
    fn push(&mut self, field: &FieldPath, kind: ErrorKind) {
        self.report.errors.push(FieldError {
            field: field.clone(),
            kind,
        });
    }

    fn invalid(&mut self, field: &FieldPath, value: &Value, detail: String) {
        self.push(
            field,
            ErrorKind::Invalid {
                value: go_value(value),
                detail,
            },
        );
    }

    /// The OpenAPI value validations of one node and everything under it.
    fn check(&mut self, schema: &Value, value: &Value, path: &FieldPath, is_root: bool) {
        let name = path.display_name().to_string();
        if value.is_null() {
            let nullable = schema.get("nullable").and_then(Value::as_bool) == Some(true);
            let typed = schema.get("type").and_then(Value::as_str);
            if nullable || typed.is_none() {
                return;
            }
        }
        let int_or_string = schema
            .get("x-kubernetes-int-or-string")
            .and_then(Value::as_bool)
            == Some(true);
        if int_or_string {
            if !(value.is_string() || type_matches("integer", value)) {
                let actual = json_type(value);
                self.push(
                    path,
                    ErrorKind::Invalid {
                        value: go_quote(actual),
                        detail: format!(
                            "{name} in body must be of type integer,string: {}",
                            go_quote(actual)
                        ),
                    },
                );
                return;
            }
        } else if let Some(expected) = schema.get("type").and_then(Value::as_str) {
            if !type_matches(expected, value) {
                let actual = json_type(value);
                self.push(
                    path,
                    ErrorKind::Invalid {
                        value: go_quote(actual),
                        detail: format!(
                            "{name} in body must be of type {expected}: {}",
                            go_quote(actual)
                        ),
                    },
                );
                return;
            }
        }

        if let Some(options) = schema.get("enum").and_then(Value::as_array) {
            if !options.iter().any(|o| json_equal(o, value)) {
                let supported = options
                    .iter()
                    .map(|o| match o {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    })
                    .collect();
                self.push(
                    path,
                    ErrorKind::NotSupported {
                        value: go_value(value),
                        supported,
                    },
                );
            }
        }

        match value {
            Value::String(s) => self.check_string(schema, s, value, path, &name),
            Value::Number(n) => self.check_number(schema, n, value, path, &name),
            Value::Array(items) => self.check_array(schema, items, path, &name),
            Value::Object(map) => self.check_object(schema, map, path, &name, is_root),
            _ => {}
        }

        for sub in schema
            .get("allOf")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            self.check(sub, value, path, is_root);
        }
        if let Some(any) = schema.get("anyOf").and_then(Value::as_array) {
            if !any.iter().any(|sub| self.passes(sub, value, path, is_root)) {
                self.invalid(
                    path,
                    value,
                    format!("{name} in body must validate at least one schema (anyOf)"),
                );
            }
        }
        if let Some(one) = schema.get("oneOf").and_then(Value::as_array) {
            let passing = one
                .iter()
                .filter(|sub| self.passes(sub, value, path, is_root))
                .count();
            if passing != 1 {
                self.invalid(
                    path,
                    value,
                    format!("{name} in body must validate one and only one schema (oneOf)"),
                );
            }
        }
        if let Some(not) = schema.get("not") {
            if self.passes(not, value, path, is_root) {
                self.invalid(
                    path,
                    value,
                    format!("{name} in body should not validate the schema (not)"),
                );
            }
        }
    }

    /// Whether `value` passes `schema` (for anyOf/oneOf/not), without recording errors.
    fn passes(&self, schema: &Value, value: &Value, path: &FieldPath, is_root: bool) -> bool {
        let mut probe = Validator {
            cel: self.cel,
            unknown_rules: UnknownRules::Skip,
            report: Report::default(),
        };
        probe.check_value_only(schema, value, path, is_root);
        probe.report.errors.is_empty()
    }

    /// anyOf/oneOf/not branches of a structural schema carry value validations only; fields
    /// they mention are not "unknown" to them.
    fn check_value_only(&mut self, schema: &Value, value: &Value, path: &FieldPath, root: bool) {
        let before = self.report.errors.len();
        self.check(schema, value, path, root);
        let kept: Vec<FieldError> = self.report.errors.drain(before..).collect();
        self.report.errors.extend(
            kept.into_iter()
                .filter(|e| e.kind != ErrorKind::UnknownField),
        );
    }

    fn check_string(
        &mut self,
        schema: &Value,
        s: &str,
        value: &Value,
        path: &FieldPath,
        name: &str,
    ) {
        let len = s.chars().count();
        if let Some(max) = schema_usize(schema, "maxLength") {
            if len > max {
                self.push(path, ErrorKind::TooLong { max });
            }
        }
        if let Some(min) = schema_usize(schema, "minLength") {
            if len < min {
                self.invalid(
                    path,
                    value,
                    format!("{name} in body should be at least {min} chars long"),
                );
            }
        }
        if let Some(pattern) = schema.get("pattern").and_then(Value::as_str) {
            match self::pattern(pattern) {
                Ok(re) => {
                    if !re.is_match(s) {
                        self.invalid(
                            path,
                            value,
                            format!("{name} in body should match '{pattern}'"),
                        );
                    }
                }
                Err(rule) => self.push(path, ErrorKind::UnsupportedRule { rule }),
            }
        }
        if let Some(format) = schema.get("format").and_then(Value::as_str) {
            if !format_ok(format, s) {
                self.push(
                    path,
                    ErrorKind::Invalid {
                        value: go_quote(s),
                        detail: format!("{name} in body must be of type {format}: {}", go_quote(s)),
                    },
                );
            }
        }
    }

    fn check_number(
        &mut self,
        schema: &Value,
        n: &serde_json::Number,
        value: &Value,
        path: &FieldPath,
        name: &str,
    ) {
        let Some(x) = n.as_f64() else { return };
        let exclusive = |key: &str| schema.get(key).and_then(Value::as_bool) == Some(true);
        if let Some(min) = schema_number(schema, "minimum") {
            if exclusive("exclusiveMinimum") && x <= min {
                self.invalid(
                    path,
                    value,
                    format!("{name} in body should be greater than {}", go_float(min)),
                );
            } else if x < min {
                self.invalid(
                    path,
                    value,
                    format!(
                        "{name} in body should be greater than or equal to {}",
                        go_float(min)
                    ),
                );
            }
        }
        if let Some(max) = schema_number(schema, "maximum") {
            if exclusive("exclusiveMaximum") && x >= max {
                self.invalid(
                    path,
                    value,
                    format!("{name} in body should be less than {}", go_float(max)),
                );
            } else if x > max {
                self.invalid(
                    path,
                    value,
                    format!(
                        "{name} in body should be less than or equal to {}",
                        go_float(max)
                    ),
                );
            }
        }
        if let Some(m) = schema_number(schema, "multipleOf") {
            if m > 0.0 && (x / m).fract() != 0.0 {
                self.invalid(
                    path,
                    value,
                    format!("{name} in body should be a multiple of {}", go_float(m)),
                );
            }
        }
    }

    fn check_array(&mut self, schema: &Value, items: &[Value], path: &FieldPath, name: &str) {
        let len = Value::from(items.len());
        if let Some(min) = schema_usize(schema, "minItems") {
            if items.len() < min {
                self.invalid(
                    path,
                    &len,
                    format!("{name} in body should have at least {min} items"),
                );
            }
        }
        if let Some(max) = schema_usize(schema, "maxItems") {
            if items.len() > max {
                self.push(
                    path,
                    ErrorKind::TooMany {
                        actual: items.len(),
                        max,
                    },
                );
            }
        }
        if schema.get("uniqueItems").and_then(Value::as_bool) == Some(true) {
            let has_dup = items
                .iter()
                .enumerate()
                .any(|(i, a)| items[..i].iter().any(|b| json_equal(a, b)));
            if has_dup {
                self.invalid(
                    path,
                    &Value::Array(items.to_vec()),
                    format!("{name} in body shouldn't contain duplicates"),
                );
            }
        }
        if let Some(item_schema) = schema.get("items") {
            for (i, item) in items.iter().enumerate() {
                self.check(item_schema, item, &path.index(i), false);
            }
        }
        match schema.get("x-kubernetes-list-type").and_then(Value::as_str) {
            Some("set") => {
                for (i, item) in items.iter().enumerate() {
                    if items[..i].iter().any(|b| json_equal(item, b)) {
                        self.push(
                            &path.index(i),
                            ErrorKind::Duplicate {
                                value: go_value(item),
                            },
                        );
                    }
                }
            }
            Some("map") => {
                let keys: Vec<&str> = schema
                    .get("x-kubernetes-list-map-keys")
                    .and_then(Value::as_array)
                    .map(|k| k.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                let key_of = |item: &Value| -> Map<String, Value> {
                    keys.iter()
                        .filter_map(|k| item.get(*k).map(|v| (k.to_string(), v.clone())))
                        .collect()
                };
                for (i, item) in items.iter().enumerate() {
                    let key = key_of(item);
                    if items[..i].iter().any(|b| key_of(b) == key) {
                        self.push(
                            &path.index(i),
                            ErrorKind::Duplicate {
                                value: Value::Object(key).to_string(),
                            },
                        );
                    }
                }
            }
            _ => {}
        }
    }

    fn check_object(
        &mut self,
        schema: &Value,
        map: &Map<String, Value>,
        path: &FieldPath,
        name: &str,
        is_root: bool,
    ) {
        if let Some(required) = schema.get("required").and_then(Value::as_array) {
            for field in required.iter().filter_map(Value::as_str) {
                if matches!(map.get(field), None | Some(Value::Null)) {
                    self.push(
                        &path.child(field),
                        ErrorKind::Required {
                            detail: String::new(),
                        },
                    );
                }
            }
        }
        if let Some(max) = schema_usize(schema, "maxProperties") {
            if map.len() > max {
                self.push(
                    path,
                    ErrorKind::TooMany {
                        actual: map.len(),
                        max,
                    },
                );
            }
        }
        if let Some(min) = schema_usize(schema, "minProperties") {
            if map.len() < min {
                self.invalid(
                    path,
                    &Value::from(map.len()),
                    format!("{name} in body should have at least {min} properties"),
                );
            }
        }
        let props = schema.get("properties").and_then(Value::as_object);
        let additional = schema.get("additionalProperties");
        let preserve = schema
            .get("x-kubernetes-preserve-unknown-fields")
            .and_then(Value::as_bool)
            == Some(true);
        for (key, child) in map {
            let child_path = path.child(key);
            if let Some(prop) = props.and_then(|p| p.get(key)) {
                // The API server prunes a null in a non-nullable field (it then counts as absent).
                if child.is_null() && prop.get("nullable").and_then(Value::as_bool) != Some(true) {
                    continue;
                }
                // ObjectMeta is validated by the API server's own rules, not by the schema.
                if is_root && key == "metadata" {
                    if !child.is_object() {
                        self.check(prop, child, &child_path, false);
                    }
                    continue;
                }
                self.check(prop, child, &child_path, false);
            } else if let Some(additional) = additional {
                match additional {
                    Value::Bool(false) => self.push(&child_path, ErrorKind::UnknownField),
                    Value::Bool(true) => {}
                    schema => self.check(schema, child, &child_path, false),
                }
            } else if is_root && matches!(key.as_str(), "apiVersion" | "kind" | "metadata") {
                // Every object has these, whether the CRD's schema lists them or not.
            } else if !preserve && (props.is_some() || schema.get("type").is_some()) {
                self.push(&child_path, ErrorKind::UnknownField);
            }
        }
    }

    /// The `x-kubernetes-validations` rules, evaluated after the value validations.
    fn cel_pass(&mut self, schema: &Value, value: &Value, path: &FieldPath) {
        if value.is_null() {
            return;
        }
        let expected = schema.get("type").and_then(Value::as_str);
        if let Some(expected) = expected {
            if !type_matches(expected, value) {
                return;
            }
        }
        match value {
            Value::Object(map) => {
                let props = schema.get("properties").and_then(Value::as_object);
                for (key, child) in map {
                    if let Some(prop) = props.and_then(|p| p.get(key)) {
                        self.cel_pass(prop, child, &path.child(key));
                    } else if let Some(additional) =
                        schema.get("additionalProperties").filter(|a| a.is_object())
                    {
                        self.cel_pass(additional, child, &path.child(key));
                    }
                }
            }
            Value::Array(items) => {
                if let Some(item_schema) = schema.get("items") {
                    for (i, item) in items.iter().enumerate() {
                        self.cel_pass(item_schema, item, &path.index(i));
                    }
                }
            }
            _ => {}
        }
        let rules = schema
            .get("x-kubernetes-validations")
            .and_then(Value::as_array);
        for rule in rules.into_iter().flatten() {
            let Some(text) = rule.get("rule").and_then(Value::as_str) else {
                continue;
            };
            match self.cel.eval(text, value) {
                Some(true) => {}
                Some(false) => {
                    let message = rule
                        .get("message")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                        .unwrap_or_else(|| format!("failed rule: {text}"));
                    let type_name = expected.unwrap_or_else(|| json_type(value));
                    if let Some(field) = rule.get("fieldPath").and_then(Value::as_str) {
                        let target = FieldPath(format!("{}{}", path.as_str(), field));
                        self.push(
                            &target,
                            ErrorKind::Invalid {
                                value: go_quote(type_name),
                                detail: message,
                            },
                        );
                    } else {
                        self.push(
                            path,
                            ErrorKind::Invalid {
                                value: go_quote(type_name),
                                detail: message,
                            },
                        );
                    }
                }
                None => match self.unknown_rules {
                    UnknownRules::Fail => self.push(
                        path,
                        ErrorKind::UnsupportedRule {
                            rule: text.to_string(),
                        },
                    ),
                    UnknownRules::Skip => self
                        .report
                        .skipped_rules
                        .push((path.clone(), text.to_string())),
                },
            }
        }
    }
}

/// JSON equality with numbers compared by value (`1` equals `1.0`).
fn json_equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| json_equal(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_equal(v, w)))
        }
        _ => a == b,
    }
}

/// The string formats of the API server's format registry that the CRDs use; unknown formats
/// (and `int32`/`int64`, which the registry ignores) pass.
fn format_ok(format: &str, s: &str) -> bool {
    match format {
        "date-time" | "datetime" => is_rfc3339(s),
        "ipv4" => s.parse::<std::net::Ipv4Addr>().is_ok(),
        "ipv6" => s.parse::<std::net::Ipv6Addr>().is_ok(),
        "byte" => is_base64(s),
        "uuid" => is_uuid(s),
        _ => true,
    }
}

fn is_rfc3339(s: &str) -> bool {
    let b = s.as_bytes();
    let digits =
        |r: std::ops::Range<usize>| b.get(r).is_some_and(|d| d.iter().all(u8::is_ascii_digit));
    if b.len() < 20 || !digits(0..4) || b[4] != b'-' || !digits(5..7) || b[7] != b'-' {
        return false;
    }
    if !digits(8..10) || !matches!(b[10], b'T' | b't' | b' ') || !digits(11..13) {
        return false;
    }
    if b[13] != b':' || !digits(14..16) || b[16] != b':' || !digits(17..19) {
        return false;
    }
    let mut i = 19;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        if i == start {
            return false;
        }
    }
    match &b[i..] {
        [b'Z'] | [b'z'] => true,
        [b'+' | b'-', h1, h2, b':', m1, m2] => [h1, h2, m1, m2].iter().all(|d| d.is_ascii_digit()),
        _ => false,
    }
}

fn is_base64(s: &str) -> bool {
    let trimmed = s.trim_end_matches('=');
    s.len() & 3 == 0 // a multiple of 4
        && s.len() - trimmed.len() <= 2
        && trimmed
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'+' || c == b'/')
}

fn is_uuid(s: &str) -> bool {
    let parts: Vec<&str> = s.split('-').collect();
    parts.iter().map(|p| p.len()).eq([8, 4, 4, 4, 12])
        && parts
            .iter()
            .all(|p| p.bytes().all(|c| c.is_ascii_hexdigit()))
}

/// The API server's own checks of an object's `metadata` (name and namespace), for kinds
/// whose names must be DNS subdomains (all custom resources).
pub fn validate_object_meta(object: &Value, namespaced: bool) -> Vec<FieldError> {
    let mut errors = Vec::new();
    let meta_path = FieldPath::root().child("metadata");
    let meta = object.get("metadata");
    let name = meta.and_then(|m| m.get("name")).and_then(Value::as_str);
    let generate = meta
        .and_then(|m| m.get("generateName"))
        .and_then(Value::as_str);
    match name {
        None | Some("") if generate.unwrap_or_default().is_empty() => errors.push(FieldError {
            field: meta_path.child("name"),
            kind: ErrorKind::Required {
                detail: "name or generateName is required".into(),
            },
        }),
        Some(name) if !name.is_empty() => {
            for detail in dns1123_subdomain_errors(name) {
                errors.push(FieldError {
                    field: meta_path.child("name"),
                    kind: ErrorKind::Invalid {
                        value: go_quote(name),
                        detail,
                    },
                });
            }
        }
        _ => {}
    }
    // A cluster-scoped object's namespace is ignored by the API server.
    let namespace = meta
        .and_then(|m| m.get("namespace"))
        .and_then(Value::as_str)
        .filter(|ns| namespaced && !ns.is_empty());
    if let Some(ns) = namespace {
        for detail in dns1123_label_errors(ns) {
            errors.push(FieldError {
                field: meta_path.child("namespace"),
                kind: ErrorKind::Invalid {
                    value: go_quote(ns),
                    detail,
                },
            });
        }
    }
    errors
}

const DNS1123_LABEL: &str = "[a-z0-9]([-a-z0-9]*[a-z0-9])?";
const DNS1123_SUBDOMAIN: &str = "[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*";

fn full_match(re: &str, s: &str) -> bool {
    pattern(&format!("^{re}$")).is_ok_and(|r| r.is_match(s))
}

/// `IsDNS1123Subdomain` of apimachinery, with its messages.
pub fn dns1123_subdomain_errors(value: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if value.len() > 253 {
        errs.push("must be no more than 253 characters".to_string());
    }
    if !full_match(DNS1123_SUBDOMAIN, value) {
        errs.push(format!(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '{DNS1123_SUBDOMAIN}')"
        ));
    }
    errs
}

/// `IsDNS1123Label` of apimachinery, with its messages.
pub fn dns1123_label_errors(value: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if value.len() > 63 {
        errs.push("must be no more than 63 characters".to_string());
    }
    if !full_match(DNS1123_LABEL, value) {
        errs.push(format!(
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '{DNS1123_LABEL}')"
        ));
    }
    errs
}

/// Every `x-kubernetes-validations` rule in a schema: (path of the node, rule, message).
pub fn cel_rules(schema: &Value) -> Vec<(FieldPath, String, String)> {
    let mut out = Vec::new();
    collect_rules(schema, &FieldPath::root(), &mut out);
    out
}

fn collect_rules(schema: &Value, path: &FieldPath, out: &mut Vec<(FieldPath, String, String)>) {
    for rule in schema
        .get("x-kubernetes-validations")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(text) = rule.get("rule").and_then(Value::as_str) {
            let message = rule
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or_default();
            out.push((path.clone(), text.to_string(), message.to_string()));
        }
    }
    if let Some(props) = schema.get("properties").and_then(Value::as_object) {
        for (name, prop) in props {
            collect_rules(prop, &path.child(name), out);
        }
    }
    if let Some(items) = schema.get("items") {
        collect_rules(items, &path.child("*"), out);
    }
    if let Some(additional) = schema.get("additionalProperties").filter(|a| a.is_object()) {
        collect_rules(additional, &path.child("*"), out);
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        for sub in schema
            .get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            collect_rules(sub, path, out);
        }
    }
}

/// Every `pattern` in a schema (to check that all of them compile).
pub fn patterns(schema: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    collect_patterns(schema, &mut out);
    out
}

fn collect_patterns(schema: &Value, out: &mut BTreeSet<String>) {
    match schema {
        Value::Object(map) => {
            for (key, v) in map {
                match key.as_str() {
                    "pattern" => {
                        if let Some(p) = v.as_str() {
                            out.insert(p.to_string());
                        }
                    }
                    "properties" => {
                        if let Some(props) = v.as_object() {
                            for prop in props.values() {
                                collect_patterns(prop, out);
                            }
                        }
                    }
                    "default" | "enum" | "example" | "x-kubernetes-validations" => {}
                    _ => collect_patterns(v, out),
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                collect_patterns(item, out);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn errors(schema: &Value, object: &Value) -> Vec<String> {
        let (_, report) = validate(schema, object, &NoCel, UnknownRules::Skip);
        report.errors.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn go_printing() {
        assert_eq!(go_quote("a\"b\\c\n\u{1}"), r#""a\"b\\c\n\x01""#);
        assert_eq!(go_value(&json!(0)), "0");
        assert_eq!(go_value(&json!(1.5)), "1.5");
        assert_eq!(go_value(&json!("x")), "\"x\"");
        assert_eq!(go_float(65535.0), "65535");
        assert_eq!(go_float(1e21), "1e+21");
    }

    #[test]
    fn api_server_wording() {
        let schema = json!({
            "type": "object",
            "properties": {
                "spec": {
                    "type": "object",
                    "required": ["ports"],
                    "properties": {
                        "ports": {"type": "array", "maxItems": 2, "minItems": 1,
                                  "items": {"type": "object", "required": ["number"],
                                            "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}},
                        "mode": {"type": "string", "enum": ["a", "b"]},
                        "name": {"type": "string", "maxLength": 3, "minLength": 1, "pattern": "^[a-z]+$"},
                        "labels": {"type": "object", "minProperties": 1,
                                   "additionalProperties": {"type": "string", "maxLength": 2}},
                        "when": {"type": "string", "format": "date-time"}
                    }
                }
            }
        });
        let got = errors(
            &schema,
            &json!({"spec": {"ports": [{"number": 0}, {"number": 70000}, {}], "mode": "c",
                             "name": "ABCD", "labels": {}, "extra": 1, "when": "yesterday"}}),
        );
        let want = [
            "spec.ports: Too many: 3: must have at most 2 items",
            "spec.ports[0].number: Invalid value: 0: spec.ports[0].number in body should be greater than or equal to 1",
            "spec.ports[1].number: Invalid value: 70000: spec.ports[1].number in body should be less than or equal to 65535",
            "spec.ports[2].number: Required value",
            "spec.mode: Unsupported value: \"c\": supported values: \"a\", \"b\"",
            "spec.name: Too long: may not be more than 3 bytes",
            "spec.name: Invalid value: \"ABCD\": spec.name in body should match '^[a-z]+$'",
            "spec.labels: Invalid value: 0: spec.labels in body should have at least 1 properties",
            "unknown field \"spec.extra\"",
            "spec.when: Invalid value: \"yesterday\": spec.when in body must be of type date-time: \"yesterday\"",
        ];
        for w in want {
            assert!(got.iter().any(|g| g == w), "missing {w:?} in {got:#?}");
        }
        assert_eq!(got.len(), want.len(), "{got:#?}");
        let got = errors(&schema, &json!({"spec": {"ports": "8000"}}));
        assert_eq!(
            got,
            ["spec.ports: Invalid value: \"string\": spec.ports in body must be of type array: \"string\""]
        );
        assert_eq!(
            errors(&schema, &json!({"spec": {}})),
            ["spec.ports: Required value"]
        );
    }

    #[test]
    fn defaults_apply_before_validation() {
        let schema = json!({"type": "object", "properties": {
            "ref": {"type": "object", "properties": {
                "kind": {"type": "string", "default": "Service"},
                "name": {"type": "string"}}}}});
        let (defaulted, _) = validate(
            &schema,
            &json!({"ref": {"name": "x"}}),
            &NoCel,
            UnknownRules::Skip,
        );
        assert_eq!(defaulted, json!({"ref": {"name": "x", "kind": "Service"}}));
    }

    #[test]
    fn list_types_and_cel_hooks() {
        struct Rules;
        impl CelRules for Rules {
            fn eval(&self, rule: &str, v: &Value) -> Option<bool> {
                (rule == "short").then(|| v.as_array().is_some_and(|a| a.len() < 3))
            }
        }
        let schema = json!({"type": "object", "properties": {
            "set": {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "set",
                    "x-kubernetes-validations": [{"rule": "short", "message": "too long a list"},
                                                 {"rule": "size(self) > 0"}]},
            "map": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}}},
                    "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}}});
        let object = json!({"set": ["a", "b", "a"], "map": [{"name": "x"}, {"name": "x"}]});
        let (_, report) = validate(&schema, &object, &Rules, UnknownRules::Fail);
        let mut got: Vec<String> = report.errors.iter().map(ToString::to_string).collect();
        got.sort();
        assert_eq!(
            got,
            [
                "map[1]: Duplicate value: {\"name\":\"x\"}",
                "set: Internal error: CEL rule \"size(self) > 0\" is not supported by this validator",
                "set: Invalid value: \"array\": too long a list",
                "set[2]: Duplicate value: \"a\"",
            ]
        );
        let (_, report) = validate(&schema, &object, &Rules, UnknownRules::Skip);
        assert_eq!(report.skipped_rules.len(), 1);
    }

    #[test]
    fn object_meta() {
        let errs = |o: Value| -> Vec<String> {
            validate_object_meta(&o, true)
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        assert_eq!(
            errs(json!({"metadata": {}})),
            ["metadata.name: Required value: name or generateName is required"]
        );
        assert!(errs(json!({"metadata": {"name": "ok.name-1", "namespace": "ns"}})).is_empty());
        let bad = errs(json!({"metadata": {"name": "Bad_Name", "namespace": "a.b"}}));
        assert!(
            bad[0].starts_with(
                "metadata.name: Invalid value: \"Bad_Name\": a lowercase RFC 1123 subdomain"
            ),
            "{bad:?}"
        );
        assert!(
            bad[1].starts_with(
                "metadata.namespace: Invalid value: \"a.b\": a lowercase RFC 1123 label"
            ),
            "{bad:?}"
        );
    }

    #[test]
    fn formats() {
        assert!(is_rfc3339("2024-01-02T03:04:05Z"));
        assert!(is_rfc3339("2024-01-02T03:04:05.123+02:00"));
        assert!(!is_rfc3339("2024-01-02"));
        assert!(is_base64("aGVsbG8="));
        assert!(!is_base64("aGVsbG8"));
        assert!(format_ok("ipv6", "::1"));
        assert!(!format_ok("ipv4", "1.2.3"));
    }

    #[test]
    fn patterns_follow_re2_and_compile_once() {
        let digits = pattern("^[0-9]+$").unwrap();
        assert!(
            Arc::ptr_eq(&digits, &pattern("^[0-9]+$").unwrap()),
            "compiled once"
        );
        // Go's regexp: an unanchored search, ASCII `\d`, `.` not matching a newline.
        assert!(pattern("b").unwrap().is_match("abc"));
        assert!(
            !pattern(r"^\d$").unwrap().is_match("\u{663}"),
            "Arabic-Indic three"
        );
        assert!(pattern(r"^\d$").unwrap().is_match("3"));
        assert!(!pattern("^a.b$").unwrap().is_match("a\nb"));
        assert!(
            pattern("(?=a)").is_err(),
            "look-around, which RE2 refuses too"
        );
    }

    #[test]
    fn a_pattern_that_cannot_compile_is_reported_not_passed() {
        let schema = json!({"type": "object", "properties": {
            "name": {"type": "string", "pattern": "(?<=x)y"}}});
        let (_, report) = validate(&schema, &json!({"name": "y"}), &NoCel, UnknownRules::Skip);
        assert!(
            report
                .errors
                .iter()
                .any(|e| matches!(&e.kind, ErrorKind::UnsupportedRule { rule } if rule.contains("(?<=x)y"))),
            "{:?}",
            report.errors
        );
    }
}
