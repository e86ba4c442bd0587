//! The Kubernetes manifests of `deploy/k8s/`, checked without a cluster: every file parses, the
//! kustomization lists files that exist, the teacher's command line (with its environment) is
//! accepted by clap and by the `teacher` binary itself, and the pieces fit together (probes on
//! `/health` at the container's port, the model volume read-only at `--model`, a GPU per
//! replica, a grace period longer than the longest request, the Service selecting the pods).

mod common;

use clap::Parser;
use std::path::PathBuf;
use xdistill_server::Args;

fn k8s_dir() -> PathBuf {
    xdistill_shared::paths::repo_root().join("deploy/k8s")
}

fn load(name: &str) -> serde_yaml::Value {
    let path = k8s_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn strings(v: &serde_yaml::Value) -> Vec<String> {
    v.as_sequence()
        .expect("a list")
        .iter()
        .map(|s| s.as_str().expect("strings").to_string())
        .collect()
}

#[test]
fn kubernetes_manifests_fit_together_and_the_teacher_accepts_its_command() {
    // Every YAML file parses; the kustomization names existing ones.
    for entry in std::fs::read_dir(k8s_dir()).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().to_string();
        if name.ends_with(".yaml") {
            load(&name);
        }
    }
    let kustomization = load("kustomization.yaml");
    let resources = strings(&kustomization["resources"]);
    for r in &resources {
        assert!(k8s_dir().join(r).is_file(), "kustomization names {r}");
    }
    assert!(resources.contains(&"deployment.yaml".to_string()));
    assert!(resources.contains(&"service.yaml".to_string()));

    let dep = load("deployment.yaml");
    assert_eq!(dep["kind"].as_str(), Some("Deployment"));
    let pod = &dep["spec"]["template"];
    let labels = &pod["metadata"]["labels"];
    assert_eq!(&dep["spec"]["selector"]["matchLabels"], labels);
    let c = &pod["spec"]["containers"][0];
    // 1. The command line: clap and the flag constraints.
    let argv = strings(&c["args"]);
    let args = Args::try_parse_from(std::iter::once("teacher".to_string()).chain(argv.clone()))
        .expect("deployment args rejected by clap");
    args.check().expect("deployment args violate a constraint");
    assert_eq!((args.host.to_string(), args.port), ("0.0.0.0".into(), 8000));
    assert_eq!(
        (args.device.as_str(), args.dtype.as_str()),
        ("cuda", "bf16")
    );
    // 2. The binary accepts it, environment included, with --model pointed at a real model
    // (--check-args does not open the device, so a CPU build checks the GPU command).
    let env: Vec<(String, String)> = c["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| {
            let name = e["name"].as_str().unwrap().to_string();
            (name, e["value"].as_str().unwrap_or("").to_string())
        })
        .collect();
    for (name, _) in &env {
        assert!(
            name.starts_with("XDISTILL_") || name == "RUST_LOG",
            "unknown variable {name}"
        );
    }
    let model = common::tiny_model("deploy-llama", "llama", "llama2", 1);
    let argv: Vec<String> = argv
        .iter()
        .map(|a| {
            if std::path::Path::new(a) == args.model {
                model.display().to_string()
            } else {
                a.clone()
            }
        })
        .collect();
    let out = std::process::Command::new(common::teacher_bin())
        .args(&argv)
        .arg("--check-args")
        .envs(env.iter().cloned())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 3. Probes on /health at the named container port.
    let port_name = c["ports"][0]["name"].as_str().unwrap();
    assert_eq!(c["ports"][0]["containerPort"].as_u64(), Some(8000));
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        let p = &c[probe]["httpGet"];
        assert_eq!(p["path"].as_str(), Some("/health"), "{probe}");
        assert_eq!(p["port"].as_str(), Some(port_name), "{probe}");
    }
    // Loading may take minutes: liveness must not kill a replica that is still loading.
    let startup = &c["startupProbe"];
    let patience =
        startup["periodSeconds"].as_u64().unwrap() * startup["failureThreshold"].as_u64().unwrap();
    assert!(patience >= 600, "startup probe waits {patience} s");
    // 4. The model volume, read-only at --model; one GPU per replica; the CUDA image.
    let mount = &c["volumeMounts"][0];
    assert_eq!(
        mount["mountPath"].as_str().map(PathBuf::from),
        Some(args.model.clone())
    );
    assert_eq!(mount["readOnly"].as_bool(), Some(true));
    let vol = &pod["spec"]["volumes"][0];
    assert_eq!(vol["name"], mount["name"]);
    let claim = vol["persistentVolumeClaim"]["claimName"].as_str().unwrap();
    assert_eq!(
        load("model-volume.yaml")["metadata"]["name"].as_str(),
        Some(claim)
    );
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"].as_u64(), Some(1));
    let compose: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(xdistill_shared::paths::repo_root().join("docker/compose.yaml"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(c["image"], compose["services"]["teacher-gpu"]["image"]);
    // 5. Graceful termination outlasts the longest request (its body may take the whole body
    // timeout to arrive, then it is scored).
    let grace = pod["spec"]["terminationGracePeriodSeconds"]
        .as_f64()
        .unwrap();
    assert!(grace >= 2.0 * args.body_timeout_secs, "grace {grace} s");
    // 6. The Service selects these pods at the container's port.
    let svc = load("service.yaml");
    assert_eq!(&svc["spec"]["selector"], labels);
    assert_eq!(
        svc["spec"]["ports"][0]["targetPort"].as_str(),
        Some(port_name)
    );
    assert_eq!(svc["spec"]["type"].as_str(), Some("ClusterIP"));
    // 7. The optional ingress hashes on the header the clients send.
    let ing = load("ingress.yaml");
    let hash = ing["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"]
        .as_str()
        .unwrap();
    let header = xdistill_shared::protocol::AFFINITY_HEADER
        .to_ascii_lowercase()
        .replace('-', "_");
    assert_eq!(hash, format!("$http_{header}"));
    assert_eq!(
        ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"],
        svc["metadata"]["name"]
    );
}
