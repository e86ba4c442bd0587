//! The loss configuration: parsing, validation, dispatch; every loss with bf16 logits ([`bf16`]).

mod bf16;

use super::*;

#[derive(Deserialize)]
struct Wrapper {
    loss: LossConfig,
}

fn parse(s: &str) -> std::result::Result<LossConfig, toml::de::Error> {
    toml::from_str::<Wrapper>(s).map(|w| w.loss)
}

#[test]
fn config_parses_tagged_toml() {
    let c = parse(
        "[loss]\nkd = { type = \"jsd\", beta = 0.25 }\ntail = \"renormalize\"\n\
         temperature = 2.0\nce = { type = \"weight\", weight = 0.1 }\n",
    )
    .unwrap();
    assert_eq!(c.kd, KdConfig::Jsd { beta: 0.25 });
    assert_eq!(c.tail, Some(TailMode::Renormalize));
    assert_eq!(c.temperature.get(), 2.0);
    assert_eq!(c.kd_weight, 1.0);
    assert_eq!(c.ce, CeConfig::Weight { weight: 0.1 });
    c.validate().unwrap();

    let c = parse("[loss]\nkd = { type = \"forward_kl\" }\nce = { type = \"dynamic\" }\n").unwrap();
    assert_eq!(c.kd, KdConfig::ForwardKl {});
    assert_eq!(c.tail, None, "unset: each loss picks its default");
    assert_eq!(c.ce, CeConfig::Dynamic {});
    assert_eq!(c.divergence(), Some(Divergence::Forward));

    let c = parse("[loss]\nkd = { type = \"total_variation\" }\n").unwrap();
    assert_eq!(c.kd, KdConfig::TotalVariation {});
    assert_eq!(c.divergence(), Some(Divergence::TotalVariation));
    assert!(!c.kd.works_across_tokenizers());

    let c = parse("[loss]\nkd = { type = \"alm\" }\n").unwrap();
    assert_eq!(c.kd, KdConfig::Alm { tau: 100.0 });
    assert!(c.kd.is_cross_tokenizer());
    let c = parse("[loss]\nkd = { type = \"first_kl\" }\n").unwrap();
    assert_eq!(c.kd, KdConfig::FirstKl {});
    assert!(c.kd.is_cross_tokenizer());
    let c = parse("[loss]\nkd = { type = \"pkl\", anchor = \"last\" }\n").unwrap();
    assert_eq!(
        c.kd,
        KdConfig::Pkl {
            anchor: Anchor::Last
        }
    );
}

#[test]
fn config_rejects_typos_and_bad_ranges() {
    assert!(parse("[loss]\nkd = { type = \"jsd\" }\n").is_err()); // beta missing
    assert!(parse("[loss]\nkd = { type = \"kl\" }\n").is_err());
    assert!(parse("[loss]\nkd = { type = \"forward_kl\", beta = 1 }\n").is_err());
    assert!(parse("[loss]\nkd = { type = \"jsd\", beta = 0.5, bta = 1 }\n").is_err());
    assert!(
        parse("[loss]\nkd = { type = \"alm\" }\nce = { type = \"dynamic\", w = 1 }\n").is_err()
    );
    assert!(parse("[loss]\nkd = { type = \"forward_kl\" }\ntemprature = 2.0\n").is_err());
    let c = parse("[loss]\nkd = { type = \"jsd\", beta = 1.5 }\n").unwrap();
    assert!(c.validate().is_err());
    assert!(parse("[loss]\nkd = { type = \"forward_kl\" }\ntemperature = 0.0\n").is_err());
}
