use xdistill_trainer::align::*;
fn main() {
    let name = std::env::args().nth(1).unwrap();
    let text = std::env::args().nth(2).unwrap();
    let t = AlignTokenizer::from_file(&xdistill_shared::paths::tokenizer_json(&name)).unwrap();
    println!("{:?} {:?}", t.bytes.kind(), t.bytes.dummy_prefix());
    let ids = t.encode(&text, true).unwrap();
    for (k, &id) in ids.iter().enumerate() {
        println!(
            "{k} {id} {:?} {:?} special={} added={}",
            t.tokenizer.id_to_token(id),
            t.bytes
                .piece(&ids, k)
                .map(|p| String::from_utf8_lossy(p.bytes()).to_string()),
            t.bytes.is_special(id),
            t.bytes.is_added(id)
        );
    }
}
