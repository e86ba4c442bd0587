//! The Kubernetes manifests of `deploy/k8s/`, checked without a cluster: every file parses, the
//! kustomization lists files that exist, the teacher's command line (with its environment) is
//! accepted by clap and by the `teacher` binary itself, and the pieces fit together (probes on
//! `/health` at the container's port, the model volume read-only at `--model`, a GPU per
//! replica, a grace period longer than the longest request, the Service selecting the pods).
//! The pods run unprivileged with resource requests, a disruption budget covers the teacher's,
//! and the trainer Jobs restart into `--resume` against the teacher's Service. The
//! data-parallel Job gives each pod its rank (the completion index), the world size of its
//! `parallelism`, and rank 0's address on its headless Service at the rendezvous port. (The
//! images these manifests name, and the trainer Jobs actually training, are
//! tests/tests/images.rs'.)

use crate::common;

use clap::Parser;
use std::path::PathBuf;
use xdistill_server::Args;

fn k8s_dir() -> PathBuf {
    xdistill_testkit::repo_root().join("deploy/k8s")
}

/// Every document of a (possibly multi-document) YAML file.
fn load_all(name: &str) -> Vec<serde_yaml::Value> {
    use serde::Deserialize;
    let path = k8s_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde_yaml::Value::deserialize(d).unwrap_or_else(|e| panic!("{name}: {e}")))
        .collect()
}

/// The one document of a YAML file.
fn load(name: &str) -> serde_yaml::Value {
    let mut docs = load_all(name);
    assert_eq!(docs.len(), 1, "{name}: one document");
    docs.remove(0)
}

/// The document of `kind` in a multi-document file (the only one of that kind).
fn doc_of_kind(docs: &[serde_yaml::Value], kind: &str) -> serde_yaml::Value {
    let found: Vec<&serde_yaml::Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind}");
    found[0].clone()
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
            assert!(!load_all(&name).is_empty(), "{name}");
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
            name.starts_with("XDISTILL_") || name == "RUST_LOG" || name == "CUDA_CACHE_PATH",
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
        &std::fs::read_to_string(xdistill_testkit::repo_root().join("docker/compose.yaml"))
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

/// A Kubernetes quantity (`4`, `500m`, `24Gi`, `8G`) in base units.
fn quantity(v: &serde_yaml::Value) -> f64 {
    let s = match v {
        serde_yaml::Value::Number(n) => return n.as_f64().expect("a number"),
        serde_yaml::Value::String(s) => s.as_str(),
        other => panic!("not a quantity: {other:?}"),
    };
    let units = [
        ("Ki", 1024f64),
        ("Mi", 1024f64.powi(2)),
        ("Gi", 1024f64.powi(3)),
        ("Ti", 1024f64.powi(4)),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("m", 1e-3),
    ];
    for (suffix, scale) in units {
        if let Some(n) = s.strip_suffix(suffix) {
            return n.parse::<f64>().unwrap_or_else(|_| panic!("quantity {s}")) * scale;
        }
    }
    s.parse().unwrap_or_else(|_| panic!("quantity {s}"))
}

/// The pod and container security settings both workloads share: a non-root user, no
/// privilege escalation, no capabilities, a read-only root file system with `/tmp` (what they
/// may write besides their volumes) on an emptyDir.
fn check_unprivileged(what: &str, pod: &serde_yaml::Value) {
    let psc = &pod["spec"]["securityContext"];
    assert_eq!(psc["runAsNonRoot"].as_bool(), Some(true), "{what}");
    let uid = psc["runAsUser"].as_u64().expect("runAsUser");
    assert!(uid > 0, "{what}: runAsUser {uid}");
    assert_eq!(
        psc["seccompProfile"]["type"].as_str(),
        Some("RuntimeDefault"),
        "{what}"
    );
    for c in pod["spec"]["containers"].as_sequence().expect("containers") {
        let sc = &c["securityContext"];
        assert_eq!(
            sc["allowPrivilegeEscalation"].as_bool(),
            Some(false),
            "{what}"
        );
        assert_eq!(sc["readOnlyRootFilesystem"].as_bool(), Some(true), "{what}");
        let drop = strings(&sc["capabilities"]["drop"]);
        assert!(drop.iter().any(|d| d == "ALL"), "{what}: drop {drop:?}");
        assert!(
            sc["capabilities"]["add"].is_null(),
            "{what}: adds capabilities"
        );
        let tmp = c["volumeMounts"]
            .as_sequence()
            .expect("mounts")
            .iter()
            .find(|m| m["mountPath"] == "/tmp")
            .unwrap_or_else(|| panic!("{what}: a read-only root needs a writable /tmp"));
        let vol = pod["spec"]["volumes"]
            .as_sequence()
            .expect("volumes")
            .iter()
            .find(|v| v["name"] == tmp["name"])
            .expect("the /tmp volume");
        assert!(vol["emptyDir"].is_mapping(), "{what}: /tmp on an emptyDir");
        // The scheduler needs requests to place the pod.
        let req = &c["resources"]["requests"];
        assert!(quantity(&req["cpu"]) >= 1.0, "{what}: cpu request");
        assert!(
            quantity(&req["memory"]) >= f64::from(1u32 << 30),
            "{what}: memory request"
        );
    }
}

#[test]
fn teacher_pods_are_unprivileged_requested_and_covered_by_a_disruption_budget() {
    let dep = load("deployment.yaml");
    let pod = &dep["spec"]["template"];
    check_unprivileged("deployment.yaml", pod);
    let c = &pod["spec"]["containers"][0];
    // The model is large: at least as much memory as a small model's weights, and the GPU.
    assert!(quantity(&c["resources"]["requests"]["memory"]) >= 8.0 * f64::from(1u32 << 30));
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"].as_u64(), Some(1));
    // The budget: applied with the rest, selecting exactly these pods, and leaving room for a
    // drain (a budget that allows no disruption blocks node maintenance forever).
    let resources = strings(&load("kustomization.yaml")["resources"]);
    assert!(resources.contains(&"pdb.yaml".to_string()), "{resources:?}");
    let pdb = load("pdb.yaml");
    assert_eq!(pdb["apiVersion"].as_str(), Some("policy/v1"));
    assert_eq!(pdb["kind"].as_str(), Some("PodDisruptionBudget"));
    let selector = pdb["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .expect("matchLabels");
    assert!(!selector.is_empty());
    for (k, v) in selector {
        assert_eq!(
            &pod["metadata"]["labels"][k], v,
            "the budget selects the teacher's pods"
        );
    }
    assert_eq!(pdb["spec"]["selector"], dep["spec"]["selector"]);
    let replicas = dep["spec"]["replicas"].as_u64().expect("replicas");
    let allowed = match (
        pdb["spec"]["maxUnavailable"].as_u64(),
        pdb["spec"]["minAvailable"].as_u64(),
    ) {
        (Some(n), None) => n,
        (None, Some(min)) => replicas.saturating_sub(min),
        other => panic!("one of maxUnavailable and minAvailable, as a number: {other:?}"),
    };
    assert!(
        allowed >= 1 && allowed < replicas,
        "{allowed} of {replicas} replicas may be down"
    );
    // No more than the rolling update takes down.
    let surge = &dep["spec"]["strategy"]["rollingUpdate"];
    assert!(allowed <= surge["maxUnavailable"].as_u64().expect("maxUnavailable"));
}

/// A `key = "value"` line of a TOML text (enough for the Job's flat config).
fn toml_string(text: &str, key: &str) -> String {
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
        })
        .unwrap_or_else(|| panic!("no {key} in the config"))
}

#[test]
fn the_trainer_job_resumes_into_its_output_volume_and_reaches_the_teacher_service() {
    check_trainer_job("trainer-job.yaml");
}

/// What every trainer Job file must hold (trainer-job.yaml, trainer-dp-job.yaml): applied on its
/// own, unprivileged, restarting into `--resume` against the teacher's Service, its config from
/// its ConfigMap, its inputs read-only and its output on persistent claims of the file. Returns
/// the file's documents.
fn check_trainer_job(name: &str) -> Vec<serde_yaml::Value> {
    let docs = load_all(name);
    // Optional: applied on its own, not with the teacher's kustomization.
    let resources = strings(&load("kustomization.yaml")["resources"]);
    assert!(!resources.contains(&name.to_string()), "{name}");
    let job = doc_of_kind(&docs, "Job");
    assert_eq!(job["apiVersion"].as_str(), Some("batch/v1"));
    let pod = &job["spec"]["template"];
    check_unprivileged(name, pod);
    let backoff = job["spec"]["backoffLimit"].as_u64().expect("backoffLimit");
    assert!((1..=10).contains(&backoff), "backoffLimit {backoff}");
    let restart = pod["spec"]["restartPolicy"].as_str();
    assert!(
        matches!(restart, Some("OnFailure") | Some("Never")),
        "{restart:?}"
    );
    let c = &pod["spec"]["containers"][0];
    let args = strings(&c["args"]);
    assert!(
        matches!(args[0].as_str(), "off-policy" | "on-policy"),
        "{args:?}"
    );
    // Every (re)start continues from the newest checkpoint: restarts lose no finished steps.
    assert!(args.iter().any(|a| a == "--resume"), "{args:?}");
    let value = |flag: &str| {
        let i = args
            .iter()
            .position(|a| a == flag)
            .unwrap_or_else(|| panic!("{flag}"));
        args[i + 1].clone()
    };
    // The teacher is the Service, by its name in the namespace and its port.
    let svc = load("service.yaml");
    assert_eq!(
        value("--teacher-url"),
        format!(
            "http://{}:{}",
            svc["metadata"]["name"].as_str().unwrap(),
            svc["spec"]["ports"][0]["port"].as_u64().unwrap()
        )
    );
    // Mounts: the config from the ConfigMap (read-only), inputs read-only, the output on a
    // persistent claim of this file.
    let mounts = c["volumeMounts"].as_sequence().expect("mounts");
    let volume = |path: &str| {
        let m = mounts
            .iter()
            .filter(|m| {
                let mp = m["mountPath"].as_str().unwrap();
                path == mp || path.starts_with(&format!("{mp}/"))
            })
            .max_by_key(|m| m["mountPath"].as_str().unwrap().len())
            .unwrap_or_else(|| panic!("{path} is on no volume"));
        let v = pod["spec"]["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|v| v["name"] == m["name"])
            .expect("the mount's volume")
            .clone();
        (m.clone(), v)
    };
    let config_path = value("--config");
    let (m, v) = volume(&config_path);
    assert_eq!(m["readOnly"].as_bool(), Some(true));
    let cm = doc_of_kind(&docs, "ConfigMap");
    assert_eq!(v["configMap"]["name"], cm["metadata"]["name"]);
    let key = config_path.rsplit('/').next().unwrap();
    let config = cm["data"][key]
        .as_str()
        .unwrap_or_else(|| panic!("the ConfigMap holds {key}"));
    let claims: Vec<String> = docs
        .iter()
        .filter(|d| d["kind"] == "PersistentVolumeClaim")
        .map(|d| d["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    for (key, writable) in [
        ("model_name", false),
        ("train_path", false),
        ("checkpoint_dir", true),
    ] {
        let path = toml_string(config, key);
        let (m, v) = volume(&path);
        let claim = v["persistentVolumeClaim"]["claimName"]
            .as_str()
            .unwrap_or_else(|| panic!("{key} = {path}: not on a persistent volume"));
        assert!(claims.iter().any(|c| c == claim), "{claim} is defined here");
        assert_eq!(
            m["readOnly"].as_bool() != Some(true),
            writable,
            "{key} = {path}"
        );
    }
    // The config names no teacher of its own: the Job's --teacher-url is the one.
    assert!(
        !config.contains("urls"),
        "teacher.urls would be overridden anyway"
    );
    docs
}

#[test]
fn the_data_parallel_job_runs_a_rank_per_pod_that_finds_rank_0_on_its_headless_service() {
    let name = "trainer-dp-job.yaml";
    let docs = check_trainer_job(name);
    let job = doc_of_kind(&docs, "Job");
    let svc = doc_of_kind(&docs, "Service");
    let pod = &job["spec"]["template"];
    let c = &pod["spec"]["containers"][0];
    let env = |var: &str| {
        c["env"]
            .as_sequence()
            .expect("env")
            .iter()
            .find(|e| e["name"] == var)
            .unwrap_or_else(|| panic!("{name}: no {var}"))
            .clone()
    };
    let value = |var: &str| {
        env(var)["value"]
            .as_str()
            .unwrap_or_else(|| panic!("{name}: {var} has no literal value"))
            .to_string()
    };
    // 1. One pod per rank, all at once: an Indexed Job whose parallelism and completions are
    // the world size every rank is told.
    assert_eq!(job["spec"]["completionMode"].as_str(), Some("Indexed"));
    let world: u64 = value("WORLD_SIZE").parse().expect("WORLD_SIZE is a number");
    assert!(world >= 2, "WORLD_SIZE {world}");
    assert_eq!(job["spec"]["completions"].as_u64(), Some(world));
    assert_eq!(job["spec"]["parallelism"].as_u64(), Some(world));
    // 2. Each pod's rank is its completion index (0..completions, each exactly once).
    let rank = env("RANK");
    assert!(rank["value"].is_null(), "RANK is per pod, not a literal");
    assert_eq!(
        rank["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        Some("metadata.annotations['batch.kubernetes.io/job-completion-index']")
    );
    // One GPU per pod: every rank is `cuda:0` of its own pod, and the config asks for the GPU.
    assert_eq!(value("LOCAL_RANK"), "0");
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"].as_u64(), Some(1));
    let cm = doc_of_kind(&docs, "ConfigMap");
    for (_, config) in cm["data"].as_mapping().expect("data") {
        let device = toml_string(config.as_str().expect("text"), "device");
        assert_eq!(device, "cuda", "policy.device");
    }
    // 3. A headless Service selecting exactly these pods: one DNS record per pod.
    assert_eq!(svc["spec"]["clusterIP"].as_str(), Some("None"));
    let selector = svc["spec"]["selector"].as_mapping().expect("a selector");
    assert!(!selector.is_empty());
    for (k, v) in selector {
        assert_eq!(
            &pod["metadata"]["labels"][k], v,
            "the Service selects the pods"
        );
    }
    // 4. Rank 0 is `<job>-0.<service>`: an Indexed Job's pod 0 has the hostname `<job>-0`, and
    // the pods' subdomain is the Service (a `hostname` of their own would lose the index).
    let job_name = job["metadata"]["name"].as_str().expect("a name");
    let svc_name = svc["metadata"]["name"].as_str().expect("a name");
    assert_eq!(pod["spec"]["subdomain"].as_str(), Some(svc_name));
    assert!(pod["spec"]["hostname"].is_null(), "hostname overridden");
    assert_eq!(value("MASTER_ADDR"), format!("{job_name}-0.{svc_name}"));
    // 5. The rendezvous port (trainer/src/dist/launch.rs: XDISTILL_DIST_PORT, else
    // MASTER_PORT + 1) is the Service's port and the container's.
    let master_port: u16 = value("MASTER_PORT").parse().expect("MASTER_PORT is a port");
    let explicit = c["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .any(|e| e["name"] == "XDISTILL_DIST_PORT");
    let port = if explicit {
        value("XDISTILL_DIST_PORT")
            .parse::<u16>()
            .expect("XDISTILL_DIST_PORT is a port")
    } else {
        master_port + 1
    };
    let ports = svc["spec"]["ports"].as_sequence().expect("ports");
    assert_eq!(ports.len(), 1, "{ports:?}");
    assert_eq!(ports[0]["port"].as_u64(), Some(u64::from(port)));
    let target = &ports[0]["targetPort"];
    let container_port = c["ports"]
        .as_sequence()
        .expect("container ports")
        .iter()
        .find(|p| match target.as_str() {
            Some(named) => p["name"] == named,
            None => p["containerPort"] == *target,
        })
        .expect("the Service's targetPort is a container port");
    assert_eq!(
        container_port["containerPort"].as_u64(),
        Some(u64::from(port))
    );
    // 6. Every rank reads the inputs and the checkpoints (`--resume`) from pods on any node:
    // the claims are ReadWriteMany.
    for claim in docs.iter().filter(|d| d["kind"] == "PersistentVolumeClaim") {
        let modes = strings(&claim["spec"]["accessModes"]);
        assert!(
            modes.iter().any(|m| m == "ReadWriteMany"),
            "{}: {modes:?}",
            claim["metadata"]["name"].as_str().unwrap_or("?")
        );
    }
}
