//! `adapter_config.json`: every PEFT LoRA field parsed, the ones that change the math either
//! honoured or refused, unknown fields kept and ignored.
//!
//! Matching follows PEFT exactly (`peft.tuners.tuners_utils.check_target_module_exists` and
//! `get_pattern_key`):
//! - a string `target_modules` is a regex that must match the whole module name (`re.fullmatch`);
//! - a list matches a name equal to an entry or ending in `.` + entry, and only then are
//!   `layers_to_transform` / `layers_pattern` applied;
//! - `exclude_modules` is checked first, with the same string/list rules;
//! - for `rank_pattern` and `alpha_pattern`, the first key in file order for which
//!   `(.*\.)?(key)$` matches the module name from its start wins.

use serde::Deserialize;
use serde_json::{Map, Value};

/// `target_modules` / `exclude_modules`: a list of names, or one regex over the full module name.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum ModuleSelector {
    /// Names; a module matches when its name equals one or ends with `.` + one.
    List(Vec<String>),
    /// A regex that must match the whole module name.
    Regex(String),
}

/// A parsed `adapter_config.json`.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct AdapterConfig {
    /// `peft_type` (must be `LORA`).
    pub peft_type: String,
    /// `task_type` (`CAUSAL_LM` or absent).
    pub task_type: Option<String>,
    /// Default rank `r`.
    pub r: i64,
    /// Default `lora_alpha`.
    pub lora_alpha: f64,
    /// rsLoRA scaling `alpha / sqrt(r)`.
    pub use_rslora: bool,
    /// Which modules are adapted.
    pub target_modules: ModuleSelector,
    /// Modules excluded even when targeted.
    pub exclude_modules: Option<ModuleSelector>,
    /// Layer indices to adapt (list `target_modules` only).
    pub layers_to_transform: Option<Vec<i64>>,
    /// Name(s) of the layer container in module paths, e.g. `layers`.
    pub layers_pattern: Option<Vec<String>>,
    /// Per-module rank overrides, in file order.
    pub rank_pattern: Vec<(String, i64)>,
    /// Per-module alpha overrides, in file order.
    pub alpha_pattern: Vec<(String, f64)>,
    /// Conv1D layout flag; PEFT resets it to false for `nn.Linear` targets (see `load`).
    pub fan_in_fan_out: bool,
    /// `none`, `all` or `lora_only`.
    pub bias: String,
    /// DoRA.
    pub use_dora: bool,
    /// Bias on `lora_B`.
    pub lora_bias: bool,
    /// Modules trained in full and saved beside the adapter.
    pub modules_to_save: Vec<String>,
    /// How the weights were initialised (`true`, `"gaussian"`, `"pissa"`, …).
    pub init_lora_weights: Value,
    /// The base model the adapter was trained on.
    pub base_model_name_or_path: Option<String>,
    /// Every field of the file, unknown ones included, in file order.
    pub raw: Map<String, Value>,
}

/// Fields outside plain LoRA that change the forward pass when set; refused unless empty.
const MATH_CHANGING: &[(&str, &str)] = &[
    ("layer_replication", "layer replication rebuilds the base model's layer stack"),
    ("alora_invocation_tokens", "activated LoRA switches the adapter on mid-sequence"),
    ("trainable_token_indices", "trainable tokens replace rows of the embedding"),
    ("target_parameters", "LoRA on raw parameters (not modules) is not implemented"),
    ("megatron_config", "Megatron-parallel LoRA layers are not implemented"),
    ("arrow_config", "Arrow routing mixes adapters per token"),
    ("monteclora_config", "MonteCLoRA samples its weights"),
    ("velora_config", "VeLoRA changes the layer's computation"),
    ("kasa_config", "KaSA changes the layer's computation"),
];

/// Boolean fields outside plain LoRA that change the forward pass when true.
const MATH_CHANGING_FLAGS: &[(&str, &str)] = &[
    ("use_qalora", "QA-LoRA pools the input before lora_A"),
    ("use_bdlora", "block-diagonal LoRA is not implemented"),
];

/// Initialisations that rewrite the base weights, so the adapter alone is not the whole change.
const BASE_REWRITING_INITS: &[&str] = &["pissa", "olora", "loftq", "corda"];

/// Why a config is refused: the field and the reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Not valid as a PEFT LoRA config.
    Invalid(String),
    /// Valid, but uses something not implemented (field, reason).
    Unsupported(String, String),
    /// DoRA.
    Dora(String),
    /// LoRA bias.
    LoraBias(String),
}

impl AdapterConfig {
    /// Parses the text of an `adapter_config.json`. Structural problems come back as a reason
    /// that names the field (`serde_path_to_error`).
    pub fn parse(text: &str) -> std::result::Result<AdapterConfig, String> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let value: Value = serde_path_to_error::deserialize(de).map_err(|e| format!("not valid JSON: {e}"))?;
        let Value::Object(raw) = value else {
            return Err("the top level is not a JSON object".to_string());
        };
        let fields: RawConfig =
            serde_path_to_error::deserialize(Value::Object(raw.clone())).map_err(|e| format!("field {e}"))?;
        let target_modules = match fields.target_modules {
            Some(ModuleSelector::Regex(s)) if s == "all-linear" => ModuleSelector::List(
                multilora_types::ModuleKind::PROJECTIONS.iter().map(|k| k.short_name().to_string()).collect(),
            ),
            Some(s) => s,
            None => return Err("field \"target_modules\" is missing or null".to_string()),
        };
        Ok(AdapterConfig {
            peft_type: fields.peft_type.unwrap_or_else(|| "LORA".to_string()),
            task_type: fields.task_type,
            r: fields.r.map_or(8, |r| r.0),
            lora_alpha: fields.lora_alpha.unwrap_or(8.0),
            use_rslora: fields.use_rslora.unwrap_or(false),
            target_modules,
            exclude_modules: fields.exclude_modules,
            layers_to_transform: fields.layers_to_transform.map(|l| l.into_vec().into_iter().map(|i| i.0).collect()),
            layers_pattern: fields.layers_pattern.map(OneOrMany::into_vec),
            rank_pattern: fields
                .rank_pattern
                .map_or_else(Vec::new, |p| p.0.into_iter().map(|(k, v)| (k, v.0)).collect()),
            alpha_pattern: fields.alpha_pattern.map_or_else(Vec::new, |p| p.0),
            fan_in_fan_out: fields.fan_in_fan_out.unwrap_or(false),
            bias: fields.bias.unwrap_or_else(|| "none".to_string()),
            use_dora: fields.use_dora.unwrap_or(false),
            lora_bias: fields.lora_bias.unwrap_or(false),
            modules_to_save: fields.modules_to_save.unwrap_or_default(),
            init_lora_weights: fields.init_lora_weights.unwrap_or(Value::Bool(true)),
            base_model_name_or_path: fields.base_model_name_or_path,
            raw,
        })
    }

    /// Refuses configs whose math this engine does not implement, before any tensor is read.
    pub(crate) fn check_supported(&self) -> std::result::Result<(), Refusal> {
        if !self.peft_type.eq_ignore_ascii_case("LORA") {
            return Err(Refusal::Unsupported(
                "peft_type".into(),
                format!("peft_type is {:?}; only LORA adapters are served", self.peft_type),
            ));
        }
        if let Some(task) = &self.task_type
            && !task.eq_ignore_ascii_case("CAUSAL_LM")
        {
            return Err(Refusal::Unsupported(
                "task_type".into(),
                format!("task_type is {task:?}; only CAUSAL_LM adapters are served"),
            ));
        }
        if self.use_dora {
            return Err(Refusal::Dora("use_dora is true".into()));
        }
        if self.lora_bias {
            return Err(Refusal::LoraBias("lora_bias is true".into()));
        }
        if !matches!(self.bias.as_str(), "none" | "all" | "lora_only") {
            return Err(Refusal::Invalid(format!("bias is {:?}; PEFT allows none, all, lora_only", self.bias)));
        }
        if self.r <= 0 {
            return Err(Refusal::Invalid(format!("r is {}; a rank must be a positive integer", self.r)));
        }
        if !self.lora_alpha.is_finite() {
            return Err(Refusal::Invalid(format!("lora_alpha is {}", self.lora_alpha)));
        }
        for (key, rank) in &self.rank_pattern {
            if *rank <= 0 {
                return Err(Refusal::Invalid(format!(
                    "rank_pattern {key:?} is {rank}; a rank must be a positive integer"
                )));
            }
        }
        for (key, alpha) in &self.alpha_pattern {
            if !alpha.is_finite() {
                return Err(Refusal::Invalid(format!("alpha_pattern {key:?} is {alpha}")));
            }
        }
        if let Some(init) = self.init_lora_weights.as_str() {
            let lower = init.to_ascii_lowercase();
            if BASE_REWRITING_INITS.iter().any(|p| lower.starts_with(p)) {
                return Err(Refusal::Unsupported(
                    "init_lora_weights".into(),
                    format!(
                        "init_lora_weights {init:?} rewrites the base weights, so the adapter alone does not reproduce the fine-tuned model; convert it to plain LoRA first"
                    ),
                ));
            }
        }
        for (field, why) in MATH_CHANGING {
            match self.raw.get(*field) {
                None | Some(Value::Null) => {}
                Some(Value::Object(m)) if m.is_empty() => {}
                Some(Value::Array(a)) if a.is_empty() => {}
                Some(_) => return Err(Refusal::Unsupported((*field).into(), (*why).into())),
            }
        }
        for (field, why) in MATH_CHANGING_FLAGS {
            match self.raw.get(*field) {
                None | Some(Value::Null) | Some(Value::Bool(false)) => {}
                Some(_) => return Err(Refusal::Unsupported((*field).into(), (*why).into())),
            }
        }
        Ok(())
    }
}

/// Compiled matchers for one config; built once per load.
#[derive(Debug)]
pub(crate) struct Matcher {
    target: Compiled,
    exclude: Option<Compiled>,
    layers: Option<(Vec<i64>, Vec<regex::Regex>)>,
    rank: Vec<(regex::Regex, i64)>,
    alpha: Vec<(regex::Regex, f64)>,
    default_rank: i64,
    default_alpha: f64,
    use_rslora: bool,
}

#[derive(Debug)]
enum Compiled {
    List(Vec<String>),
    Regex(regex::Regex),
}

impl Compiled {
    fn new(sel: &ModuleSelector, field: &str) -> std::result::Result<Compiled, String> {
        Ok(match sel {
            ModuleSelector::List(l) => Compiled::List(l.clone()),
            ModuleSelector::Regex(r) => Compiled::Regex(compile(&format!("^(?:{r})$"), field, r)?),
        })
    }

    /// Exact name or `.`-suffix for lists (the second value says it matched exactly); full
    /// match for a regex.
    fn matches(&self, name: &str) -> Option<bool> {
        match self {
            Compiled::List(l) => {
                if l.iter().any(|t| t == name) {
                    Some(true)
                } else if l.iter().any(|t| {
                    name.len() > t.len()
                        && name.ends_with(t.as_str())
                        && name.as_bytes()[name.len() - t.len() - 1] == b'.'
                }) {
                    Some(false)
                } else {
                    None
                }
            }
            Compiled::Regex(r) => r.is_match(name).then_some(true),
        }
    }
}

fn compile(pattern: &str, field: &str, original: &str) -> std::result::Result<regex::Regex, String> {
    regex::RegexBuilder::new(pattern)
        .size_limit(1 << 20)
        .build()
        .map_err(|e| format!("{field} pattern {original:?} is not a supported regex: {e}"))
}

impl Matcher {
    /// Compiles every pattern of `config`; a pattern Rust's regex cannot take is an error.
    pub(crate) fn new(config: &AdapterConfig) -> std::result::Result<Matcher, String> {
        let layers = match &config.layers_to_transform {
            Some(idx) if !idx.is_empty() && matches!(config.target_modules, ModuleSelector::List(_)) => {
                let patterns = match &config.layers_pattern {
                    Some(p) if !p.is_empty() => p
                        .iter()
                        .map(|p| compile(&format!(r"^.*\.{p}\.(\d+)\."), "layers_pattern", p))
                        .collect::<std::result::Result<Vec<_>, _>>()?,
                    _ => vec![compile(r"^.*\.[^.]*\.(\d+)\.", "layers_pattern", "<default>")?],
                };
                Some((idx.clone(), patterns))
            }
            _ => None,
        };
        let key = |k: &str, field: &str| compile(&format!(r"^(?:.*\.)?(?:{k})$"), field, k);
        Ok(Matcher {
            target: Compiled::new(&config.target_modules, "target_modules")?,
            exclude: config.exclude_modules.as_ref().map(|e| Compiled::new(e, "exclude_modules")).transpose()?,
            layers,
            rank: config
                .rank_pattern
                .iter()
                .map(|(k, r)| Ok((key(k, "rank_pattern")?, *r)))
                .collect::<std::result::Result<_, String>>()?,
            alpha: config
                .alpha_pattern
                .iter()
                .map(|(k, a)| Ok((key(k, "alpha_pattern")?, *a)))
                .collect::<std::result::Result<_, String>>()?,
            default_rank: config.r,
            default_alpha: config.lora_alpha,
            use_rslora: config.use_rslora,
        })
    }

    /// Whether PEFT would wrap the module called `name`.
    pub(crate) fn targets(&self, name: &str) -> bool {
        if let Some(ex) = &self.exclude
            && ex.matches(name).is_some()
        {
            return false;
        }
        match self.target.matches(name) {
            None => false,
            Some(true) => true,
            Some(false) => match &self.layers {
                None => true,
                Some((idx, patterns)) => patterns
                    .iter()
                    .find_map(|p| p.captures(name))
                    .and_then(|c| c.get(1)?.as_str().parse::<i64>().ok())
                    .is_some_and(|layer| idx.contains(&layer)),
            },
        }
    }

    /// `(rank, alpha, scaling)` for the module called `name`.
    pub(crate) fn rank_alpha(&self, name: &str) -> (i64, f64, f64) {
        let rank = self.rank.iter().find(|(re, _)| re.is_match(name)).map_or(self.default_rank, |(_, r)| *r);
        let alpha = self.alpha.iter().find(|(re, _)| re.is_match(name)).map_or(self.default_alpha, |(_, a)| *a);
        let denom = if self.use_rslora { (rank as f64).sqrt() } else { rank as f64 };
        (rank, alpha, alpha / denom)
    }

    /// Whether a list `target_modules` entry names a module kind this engine knows. Regex targets
    /// return `None` (they are checked through the tensors instead).
    pub(crate) fn unknown_list_entry(config: &AdapterConfig) -> Option<String> {
        let ModuleSelector::List(list) = &config.target_modules else { return None };
        list.iter()
            .find(|entry| {
                let last = entry.rsplit('.').next().unwrap_or(entry);
                // The fused modules of a Phi-3 checkpoint are matched against its own names.
                multilora_types::ModuleKind::from_short_name(last).is_none() && !FUSED_MODULES.contains(&last)
            })
            .cloned()
    }
}

/// The short names of the fused projections a checkpoint may store (Phi-3's), which adapters of
/// it target ([`crate::ModelShapes::peft_module`]).
pub(crate) const FUSED_MODULES: [&str; 2] = ["qkv_proj", "gate_up_proj"];

/// The fields of `adapter_config.json` this engine reads, as written (all optional here; the
/// defaults are PEFT's, applied in [`AdapterConfig::parse`]). Unknown fields are kept in
/// [`AdapterConfig::raw`] and checked against the math-changing ones by name.
#[derive(Debug, Deserialize)]
struct RawConfig {
    peft_type: Option<String>,
    task_type: Option<String>,
    r: Option<Int>,
    lora_alpha: Option<f64>,
    use_rslora: Option<bool>,
    target_modules: Option<ModuleSelector>,
    exclude_modules: Option<ModuleSelector>,
    layers_to_transform: Option<OneOrMany<Int>>,
    layers_pattern: Option<OneOrMany<String>>,
    rank_pattern: Option<InOrder<Int>>,
    alpha_pattern: Option<InOrder<f64>>,
    fan_in_fan_out: Option<bool>,
    bias: Option<String>,
    use_dora: Option<bool>,
    lora_bias: Option<bool>,
    modules_to_save: Option<Vec<String>>,
    init_lora_weights: Option<Value>,
    base_model_name_or_path: Option<String>,
}

/// An integer, also when written as an integral float (`8.0`), as Python's `json` may write it.
#[derive(Clone, Copy, Debug)]
struct Int(i64);

impl<'de> Deserialize<'de> for Int {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Int, D::Error> {
        let n = serde_json::Number::deserialize(d)?;
        n.as_i64()
            .or_else(|| n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 1e15).map(|f| f as i64))
            .map(Int)
            .ok_or_else(|| serde::de::Error::custom(format!("{n} is not an integer")))
    }
}

/// One value or a list of them (`layers_to_transform: 3` or `[0, 1]`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    fn into_vec(self) -> Vec<T> {
        match self {
            OneOrMany::One(t) => vec![t],
            OneOrMany::Many(v) => v,
        }
    }
}

/// An object's entries in file order (the first matching `rank_pattern` key wins).
#[derive(Debug)]
struct InOrder<T>(Vec<(String, T)>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for InOrder<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<InOrder<T>, D::Error> {
        struct Entries<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Entries<T> {
            type Value = InOrder<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<InOrder<T>, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, T>()? {
                    entries.push(entry);
                }
                Ok(InOrder(entries))
            }
        }
        d.deserialize_map(Entries(std::marker::PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: Value) -> AdapterConfig {
        let mut base = serde_json::json!({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]});
        for (k, v) in extra.as_object().unwrap() {
            base[k] = v.clone();
        }
        AdapterConfig::parse(&base.to_string()).unwrap()
    }

    #[test]
    fn list_targets_match_suffix_and_layers() {
        let c = cfg(serde_json::json!({"layers_to_transform": [0, 2], "layers_pattern": "layers"}));
        let m = Matcher::new(&c).unwrap();
        assert!(m.targets("model.layers.0.self_attn.q_proj"));
        assert!(!m.targets("model.layers.1.self_attn.q_proj"));
        assert!(m.targets("model.layers.2.self_attn.v_proj"));
        assert!(!m.targets("model.layers.2.self_attn.k_proj"));
        // An exact list entry bypasses the layer filter, as in PEFT.
        let c =
            cfg(serde_json::json!({"target_modules": ["model.layers.1.self_attn.q_proj"], "layers_to_transform": [0]}));
        assert!(Matcher::new(&c).unwrap().targets("model.layers.1.self_attn.q_proj"));
    }

    #[test]
    fn regex_targets_fullmatch_and_ignore_layers() {
        let c = cfg(
            serde_json::json!({"target_modules": r".*\.layers\.[13]\.self_attn\.q_proj", "layers_to_transform": [0]}),
        );
        let m = Matcher::new(&c).unwrap();
        assert!(m.targets("model.layers.1.self_attn.q_proj"));
        assert!(!m.targets("model.layers.0.self_attn.q_proj"));
        assert!(!m.targets("model.layers.1.self_attn.q_proj_extra"));
    }

    #[test]
    fn patterns_take_the_first_key_in_file_order() {
        let c = AdapterConfig::parse(
            r#"{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
                "rank_pattern": {"q_proj": 4, "layers.0.self_attn.q_proj": 2},
                "alpha_pattern": {"layers\\.0\\.self_attn\\.q_proj": 3}}"#,
        )
        .unwrap();
        let m = Matcher::new(&c).unwrap();
        assert_eq!(m.rank_alpha("model.layers.0.self_attn.q_proj"), (4, 3.0, 0.75));
        assert_eq!(m.rank_alpha("model.layers.1.self_attn.q_proj"), (4, 16.0, 4.0));
        // A key matches at a `.` boundary or from the start, never mid-name.
        let c = cfg(serde_json::json!({"rank_pattern": {"_proj": 2}}));
        assert_eq!(Matcher::new(&c).unwrap().rank_alpha("model.layers.0.self_attn.q_proj").0, 8);
    }

    #[test]
    fn exclusions_win() {
        let c = cfg(serde_json::json!({"exclude_modules": ["model.layers.0.self_attn.q_proj"]}));
        let m = Matcher::new(&c).unwrap();
        assert!(!m.targets("model.layers.0.self_attn.q_proj"));
        assert!(m.targets("model.layers.1.self_attn.q_proj"));
    }

    #[test]
    fn refusals() {
        assert!(matches!(cfg(serde_json::json!({"use_dora": true})).check_supported(), Err(Refusal::Dora(_))));
        assert!(matches!(cfg(serde_json::json!({"r": 0})).check_supported(), Err(Refusal::Invalid(_))));
        assert!(matches!(cfg(serde_json::json!({"r": -4})).check_supported(), Err(Refusal::Invalid(_))));
        assert!(matches!(
            cfg(serde_json::json!({"init_lora_weights": "pissa_niter_4"})).check_supported(),
            Err(Refusal::Unsupported(f, _)) if f == "init_lora_weights"
        ));
        assert!(matches!(
            cfg(serde_json::json!({"layer_replication": [[0, 2]]})).check_supported(),
            Err(Refusal::Unsupported(f, _)) if f == "layer_replication"
        ));
        assert!(cfg(serde_json::json!({"loftq_config": {}, "some_future_field": 3})).check_supported().is_ok());
        assert!(AdapterConfig::parse(r#"{"r": 8}"#).is_err());
        assert!(AdapterConfig::parse("[1]").is_err());
    }
}
