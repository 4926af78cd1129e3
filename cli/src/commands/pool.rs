//! `prefixroute pool FILE`: validates InferencePools by the CRD's rules and resolves their
//! endpoints the way an endpoint picker does; prints a report, the `--endpoint` flags for
//! `prefixroute serve`, or the plugin's JSON configuration.
//!
//! Exit codes: 0 valid, 1 an InferencePool is invalid, 2 usage or input errors.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use prefixroute_core::config::PluginConfig;
use prefixroute_pool::{self as pool, InferencePool, Pod, PoolError, Resolution};
use serde::Deserialize;
use serde_json::Value;

#[derive(clap::Args)]
pub struct Args {
    /// YAML (several documents allowed) or JSON: InferencePools, Pods, Lists, or the output of
    /// `kubectl get inferencepools.inference.networking.k8s.io,pods -o json`; `-` reads stdin.
    file: PathBuf,
    /// Print the `--endpoint NAME=http://IP:PORT` flags for `prefixroute serve`, one per line.
    #[arg(long, conflicts_with = "config")]
    args: bool,
    /// Print the plugin's JSON configuration with the resolved endpoints.
    #[arg(long)]
    config: bool,
    /// With --config: the plugin configuration to start from (its endpoints are replaced).
    #[arg(long, value_name = "JSON", requires = "config")]
    base: Option<PathBuf>,
    /// With --config: print the JSON on one line (what kind/up.sh embeds in manifests).
    #[arg(long, requires = "config")]
    compact: bool,
    /// The pool to use when the input has several.
    #[arg(long, value_name = "NAME")]
    pool: Option<String>,
    /// Namespace of objects that name none (as kubectl's current namespace would).
    #[arg(short, long, default_value = "default")]
    namespace: String,
}

/// Reads FILE (or stdin) into Kubernetes objects, Lists flattened.
fn read_objects(path: &Path) -> Result<Vec<Value>> {
    let text = if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("cannot read stdin")?;
        s
    } else {
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?
    };
    let documents =
        parse_documents(&text).with_context(|| format!("bad input {}", path.display()))?;
    let mut objects = Vec::new();
    for doc in documents {
        match doc {
            Value::Array(items) => {
                for item in items {
                    pool::flatten_lists(item, &mut objects);
                }
            }
            other => pool::flatten_lists(other, &mut objects),
        }
    }
    Ok(objects)
}

/// JSON when the text starts like JSON (a stream of values is fine), else multi-document YAML.
fn parse_documents(text: &str) -> Result<Vec<Value>> {
    let start = text.trim_start();
    if start.starts_with('{') || start.starts_with('[') {
        let mut docs = Vec::new();
        for value in serde_json::Deserializer::from_str(text).into_iter::<Value>() {
            docs.push(value.context("invalid JSON")?);
        }
        return Ok(docs);
    }
    let mut docs = Vec::new();
    for (i, document) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(document)
            .with_context(|| format!("invalid YAML in document {}", i + 1))?;
        docs.push(value);
    }
    Ok(docs)
}

pub fn run(args: Args) -> Result<()> {
    let objects = read_objects(&args.file)?;
    let pods: Vec<Pod> = objects
        .iter()
        .filter_map(|o| Pod::from_value(o, &args.namespace))
        .collect();
    let mut pool_objects: Vec<&Value> = objects
        .iter()
        .filter(|o| pool::is_inference_pool(o))
        .collect();
    if pool_objects.is_empty() {
        bail!("no InferencePool in {}", args.file.display());
    }
    if let Some(wanted) = &args.pool {
        let names: Vec<String> = pool_objects.iter().map(|o| name_of(o)).collect();
        pool_objects.retain(|o| &name_of(o) == wanted);
        if pool_objects.is_empty() {
            bail!(
                "no InferencePool named {wanted:?} in {} (it has: {})",
                args.file.display(),
                names.join(", ")
            );
        }
    }
    let results: Vec<Result<InferencePool, PoolError>> = pool_objects
        .iter()
        .map(|o| pool::validate(o, &args.namespace))
        .collect();
    let invalid: Vec<&PoolError> = results.iter().filter_map(|r| r.as_ref().err()).collect();

    if args.args || args.config {
        if results.len() > 1 {
            let names: Vec<String> = pool_objects.iter().map(|o| name_of(o)).collect();
            bail!(
                "the input has {} InferencePools ({}); choose one with --pool NAME",
                names.len(),
                names.join(", ")
            );
        }
        let pool = match &results[0] {
            Ok(pool) => pool,
            Err(err) => exit_invalid(&[err]),
        };
        let resolution = pool::resolve(pool, &pods);
        if resolution.endpoints.is_empty() {
            bail!("{}", no_endpoints(pool, &resolution, pods.is_empty()));
        }
        let mut out = std::io::stdout().lock();
        if args.args {
            for e in &resolution.endpoints {
                writeln!(out, "--endpoint {}={}", e.name, e.url())?;
            }
        } else {
            let base = match &args.base {
                Some(path) => {
                    let bytes = std::fs::read(path)
                        .with_context(|| format!("cannot read {}", path.display()))?;
                    serde_json::from_slice::<PluginConfig>(&bytes).with_context(|| {
                        format!("{} is not a plugin configuration", path.display())
                    })?
                }
                None => PluginConfig::default(),
            };
            let config = resolution
                .plugin_config(base)
                .context("the resolved plugin configuration is invalid")?;
            let json = if args.compact {
                serde_json::to_string(&config)?
            } else {
                serde_json::to_string_pretty(&config)?
            };
            writeln!(out, "{json}")?;
        }
        return Ok(());
    }

    let mut out = std::io::stdout().lock();
    for pool in results.iter().flatten() {
        report(&mut out, pool, &pool::resolve(pool, &pods), pods.is_empty())?;
    }
    out.flush()?;
    drop(out);
    if !invalid.is_empty() {
        exit_invalid(&invalid);
    }
    Ok(())
}

fn name_of(object: &Value) -> String {
    object
        .get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

/// Prints the API server's errors and exits 1 (2 is for usage and input errors).
fn exit_invalid(errors: &[&PoolError]) -> ! {
    let _ = std::io::stdout().flush();
    let mut err = std::io::stderr().lock();
    for e in errors {
        let _ = writeln!(err, "{e}");
    }
    let _ = err.flush();
    std::process::exit(1)
}

fn no_endpoints(pool: &InferencePool, r: &Resolution, no_pods: bool) -> String {
    if no_pods {
        return format!(
            "InferencePool {pool} has no endpoints: the input has no Pods (use the output of \
             `kubectl get inferencepools.inference.networking.k8s.io,pods -n {} -o json`)",
            pool.namespace
        );
    }
    if r.selected.is_empty() {
        return format!(
            "InferencePool {pool} has no endpoints: no Pod in namespace {:?} has the labels {}",
            pool.namespace,
            labels(pool)
        );
    }
    let reasons: Vec<String> = r
        .excluded
        .iter()
        .map(|(pod, why)| format!("{pod}: {why}"))
        .collect();
    format!(
        "InferencePool {pool} has no endpoints: {} selected Pods, none Ready with a podIP ({})",
        r.selected.len(),
        reasons.join("; ")
    )
}

fn labels(pool: &InferencePool) -> String {
    pool.match_labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn report(out: &mut impl Write, pool: &InferencePool, r: &Resolution, no_pods: bool) -> Result<()> {
    let ports: Vec<String> = pool.target_ports.iter().map(u16::to_string).collect();
    writeln!(out, "InferencePool {pool}: valid")?;
    writeln!(out, "  selector        {}", labels(pool))?;
    writeln!(out, "  targetPorts     {}", ports.join(", "))?;
    writeln!(out, "  appProtocol     {}", pool.app_protocol)?;
    match &pool.endpoint_picker {
        Some(epp) => {
            let port = epp.port.map(|p| format!(":{p}")).unwrap_or_default();
            let group = if epp.group.is_empty() {
                String::new()
            } else {
                format!(".{}", epp.group)
            };
            writeln!(
                out,
                "  endpointPicker  {}{group} {}{port} ({})",
                epp.kind, epp.name, epp.failure_mode
            )?;
        }
        None => writeln!(out, "  endpointPicker  none")?,
    }
    if no_pods {
        writeln!(
            out,
            "  endpoints       unknown: the input has no Pods (pass `kubectl get \
             inferencepools.inference.networking.k8s.io,pods -n {} -o json`)",
            pool.namespace
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "  endpoints       {} ({} of {} selected Pods)",
        r.endpoints.len(),
        r.selected.len() - r.excluded.len(),
        r.selected.len()
    )?;
    if !r.endpoints.is_empty() {
        let name_w = r
            .endpoints
            .iter()
            .map(|e| e.name.len())
            .max()
            .unwrap_or(0)
            .max(4);
        let addr_w = r
            .endpoints
            .iter()
            .map(|e| e.address().len())
            .max()
            .unwrap_or(0)
            .max(7);
        writeln!(out, "    {:<name_w$}  {:<addr_w$}  POD", "NAME", "ADDRESS")?;
        for e in &r.endpoints {
            writeln!(
                out,
                "    {:<name_w$}  {:<addr_w$}  {}",
                e.name,
                e.address(),
                e.pod
            )?;
        }
    }
    for (pod, why) in &r.excluded {
        writeln!(out, "    excluded: {pod} ({why})")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_json_inputs() {
        let yaml = "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\n---\n# comment only\n---\nkind: List\napiVersion: v1\nitems: []\n";
        let docs = parse_documents(yaml).unwrap();
        assert_eq!(docs.len(), 3);
        assert_eq!(docs[0]["metadata"]["name"], "a");
        let json = r#"{"kind":"List","items":[]} {"kind":"Pod"}"#;
        assert_eq!(parse_documents(json).unwrap().len(), 2);
        assert!(parse_documents("a: [").is_err());
        // Quoted "True" stays a string (Pod conditions), unquoted true is a boolean.
        let docs = parse_documents("status: \"True\"\nok: true\n").unwrap();
        assert_eq!(docs[0]["status"], "True");
        assert_eq!(docs[0]["ok"], true);
    }
}
