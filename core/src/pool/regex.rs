//! A small regular-expression engine for the `pattern` keyword of CRD schemas.
//!
//! Kubernetes checks `pattern` with Go's RE2 `regexp.MatchString`: an unanchored search, `.`
//! not matching `\n`, `^`/`$` anchoring to the whole text. This engine implements the part of
//! that syntax the CRDs use (alternation, capturing and `(?:` groups, classes with ranges and
//! negation, Perl classes `\d \w \s`, escapes, `* + ? {n} {n,} {n,m}`, `^`, `$`, `.`) and
//! runs it as a Pike VM: time linear in the text, no catastrophic backtracking, no recursion
//! on the input. Anything else (back-references, look-around, flags) is refused at compile
//! time, so a CRD that starts using it fails loudly instead of matching wrongly.

use std::fmt;

/// Why a pattern was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegexError {
    pub pattern: String,
    pub reason: String,
}

impl fmt::Display for RegexError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unsupported pattern {:?}: {}", self.pattern, self.reason)
    }
}

impl std::error::Error for RegexError {}

/// Counted repetitions are expanded into copies; this bounds the program size.
const MAX_REPEAT: u32 = 1000;
const MAX_PROGRAM: usize = 100_000;

#[derive(Debug, Clone)]
struct Class {
    ranges: Vec<(char, char)>,
    negated: bool,
}

impl Class {
    fn single(c: char) -> Class {
        Class {
            ranges: vec![(c, c)],
            negated: false,
        }
    }

    fn matches(&self, c: char) -> bool {
        self.ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != self.negated
    }
}

#[derive(Debug, Clone)]
enum Node {
    Empty,
    Class(Class),
    /// `.`: any character but `\n`.
    Any,
    Begin,
    End,
    Concat(Vec<Node>),
    Alt(Vec<Node>),
    Repeat {
        node: Box<Node>,
        min: u32,
        max: Option<u32>,
    },
}

#[derive(Debug, Clone)]
enum Inst {
    Class(Class),
    Any,
    Begin,
    End,
    Split(usize, usize),
    Jmp(usize),
    Match,
}

/// A compiled pattern.
#[derive(Debug, Clone)]
pub struct Regex {
    pattern: String,
    program: Vec<Inst>,
}

impl Regex {
    pub fn new(pattern: &str) -> Result<Regex, RegexError> {
        let err = |reason: String| RegexError {
            pattern: pattern.to_string(),
            reason,
        };
        let mut parser = Parser {
            chars: pattern.chars().collect(),
            pos: 0,
        };
        let node = parser.parse_alt().map_err(err)?;
        if parser.pos != parser.chars.len() {
            return Err(err(format!(
                "unexpected {:?} at {}",
                parser.chars[parser.pos], parser.pos
            )));
        }
        let mut program = Vec::new();
        compile(&node, &mut program).map_err(err)?;
        program.push(Inst::Match);
        Ok(Regex {
            pattern: pattern.to_string(),
            program,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.pattern
    }

    /// True when the pattern matches somewhere in `text` (Go's `MatchString`).
    pub fn is_match(&self, text: &str) -> bool {
        let chars: Vec<char> = text.chars().collect();
        let n = self.program.len();
        let mut current = ThreadList::new(n);
        let mut next = ThreadList::new(n);
        for pos in 0..=chars.len() {
            // A search may start at every position.
            self.add(&mut current, 0, pos, chars.len());
            if current.matched {
                return true;
            }
            let Some(&c) = chars.get(pos) else { break };
            next.clear();
            for i in 0..current.pcs.len() {
                let pc = current.pcs[i];
                let advance = match &self.program[pc] {
                    Inst::Class(class) => class.matches(c),
                    Inst::Any => c != '\n',
                    _ => false,
                };
                if advance {
                    self.add(&mut next, pc + 1, pos + 1, chars.len());
                }
            }
            if next.matched {
                return true;
            }
            std::mem::swap(&mut current, &mut next);
        }
        current.matched
    }

    /// Follows the empty transitions from `pc` (iteratively: no recursion on the program).
    fn add(&self, list: &mut ThreadList, pc: usize, pos: usize, len: usize) {
        let mut stack = vec![pc];
        while let Some(pc) = stack.pop() {
            if list.seen[pc] == list.generation {
                continue;
            }
            list.seen[pc] = list.generation;
            match &self.program[pc] {
                Inst::Jmp(to) => stack.push(*to),
                Inst::Split(a, b) => {
                    stack.push(*b);
                    stack.push(*a);
                }
                Inst::Begin => {
                    if pos == 0 {
                        stack.push(pc + 1);
                    }
                }
                Inst::End => {
                    if pos == len {
                        stack.push(pc + 1);
                    }
                }
                Inst::Match => list.matched = true,
                Inst::Class(_) | Inst::Any => list.pcs.push(pc),
            }
        }
    }
}

struct ThreadList {
    pcs: Vec<usize>,
    seen: Vec<u32>,
    generation: u32,
    matched: bool,
}

impl ThreadList {
    fn new(n: usize) -> ThreadList {
        ThreadList {
            pcs: Vec::new(),
            seen: vec![0; n],
            generation: 1,
            matched: false,
        }
    }

    fn clear(&mut self) {
        self.pcs.clear();
        self.generation += 1;
        self.matched = false;
    }
}

fn compile(node: &Node, out: &mut Vec<Inst>) -> Result<(), String> {
    if out.len() > MAX_PROGRAM {
        return Err("pattern expands to too large a program".into());
    }
    match node {
        Node::Empty => {}
        Node::Class(c) => out.push(Inst::Class(c.clone())),
        Node::Any => out.push(Inst::Any),
        Node::Begin => out.push(Inst::Begin),
        Node::End => out.push(Inst::End),
        Node::Concat(nodes) => {
            for n in nodes {
                compile(n, out)?;
            }
        }
        Node::Alt(branches) => {
            // split L1, next; L1: branch; jmp end; next: split ... ; last branch
            let mut jumps = Vec::new();
            for (i, branch) in branches.iter().enumerate() {
                if i + 1 < branches.len() {
                    let split = out.len();
                    out.push(Inst::Split(split + 1, 0));
                    compile(branch, out)?;
                    jumps.push(out.len());
                    out.push(Inst::Jmp(0));
                    let next = out.len();
                    out[split] = Inst::Split(split + 1, next);
                } else {
                    compile(branch, out)?;
                }
            }
            let end = out.len();
            for j in jumps {
                out[j] = Inst::Jmp(end);
            }
        }
        Node::Repeat { node, min, max } => {
            for _ in 0..*min {
                compile(node, out)?;
            }
            match max {
                None => {
                    // L: split body, end; body; jmp L
                    let split = out.len();
                    out.push(Inst::Split(split + 1, 0));
                    compile(node, out)?;
                    out.push(Inst::Jmp(split));
                    let end = out.len();
                    out[split] = Inst::Split(split + 1, end);
                }
                Some(max) => {
                    let mut splits = Vec::new();
                    for _ in *min..*max {
                        splits.push(out.len());
                        out.push(Inst::Split(0, 0));
                        compile(node, out)?;
                    }
                    let end = out.len();
                    for s in splits {
                        out[s] = Inst::Split(s + 1, end);
                    }
                }
            }
        }
    }
    Ok(())
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn parse_alt(&mut self) -> Result<Node, String> {
        let mut branches = vec![self.parse_concat()?];
        while self.eat('|') {
            branches.push(self.parse_concat()?);
        }
        Ok(if branches.len() == 1 {
            branches.pop().unwrap_or(Node::Empty)
        } else {
            Node::Alt(branches)
        })
    }

    fn parse_concat(&mut self) -> Result<Node, String> {
        let mut items = Vec::new();
        while let Some(c) = self.peek() {
            if c == '|' || c == ')' {
                break;
            }
            let atom = self.parse_atom()?;
            items.push(self.parse_quantifiers(atom)?);
        }
        Ok(match items.len() {
            0 => Node::Empty,
            1 => items.pop().unwrap_or(Node::Empty),
            _ => Node::Concat(items),
        })
    }

    fn parse_quantifiers(&mut self, mut atom: Node) -> Result<Node, String> {
        loop {
            let (min, max) = match self.peek() {
                Some('*') => {
                    self.pos += 1;
                    (0, None)
                }
                Some('+') => {
                    self.pos += 1;
                    (1, None)
                }
                Some('?') => {
                    self.pos += 1;
                    (0, Some(1))
                }
                Some('{') => match self.parse_counted()? {
                    Some(range) => range,
                    None => return Ok(atom),
                },
                _ => return Ok(atom),
            };
            if matches!(atom, Node::Begin | Node::End | Node::Empty) {
                return Err("repetition of an empty expression".into());
            }
            // A trailing `?` makes the repetition lazy; it does not change whether text matches.
            self.eat('?');
            if max.is_some_and(|m| m < min) {
                return Err(format!("invalid repeat count {{{min},{max:?}}}"));
            }
            if min > MAX_REPEAT || max.is_some_and(|m| m > MAX_REPEAT) {
                return Err("repeat count too large".into());
            }
            atom = Node::Repeat {
                node: Box::new(atom),
                min,
                max,
            };
        }
    }

    /// `{n}`, `{n,}`, `{n,m}`; a `{` that does not start a valid count is a literal (as in RE2).
    fn parse_counted(&mut self) -> Result<Option<(u32, Option<u32>)>, String> {
        let start = self.pos;
        self.pos += 1;
        let read_num = |p: &mut Parser| -> Option<u32> {
            let s = p.pos;
            while p.peek().is_some_and(|c| c.is_ascii_digit()) {
                p.pos += 1;
            }
            if p.pos == s {
                return None;
            }
            p.chars[s..p.pos].iter().collect::<String>().parse().ok()
        };
        let Some(min) = read_num(self) else {
            self.pos = start;
            return Ok(None);
        };
        let max = if self.eat(',') {
            if self.peek() == Some('}') {
                None
            } else {
                match read_num(self) {
                    Some(m) => Some(m),
                    None => {
                        self.pos = start;
                        return Ok(None);
                    }
                }
            }
        } else {
            Some(min)
        };
        if !self.eat('}') {
            self.pos = start;
            return Ok(None);
        }
        Ok(Some((min, max)))
    }

    fn parse_atom(&mut self) -> Result<Node, String> {
        let Some(c) = self.peek() else {
            return Err("unexpected end of pattern".into());
        };
        self.pos += 1;
        match c {
            '(' => {
                if self.eat('?') && !self.eat(':') {
                    return Err("only (?: groups are supported (no flags or look-around)".into());
                }
                let inner = self.parse_alt()?;
                if !self.eat(')') {
                    return Err("missing )".into());
                }
                Ok(inner)
            }
            ')' => Err("unmatched )".into()),
            '[' => self.parse_class().map(Node::Class),
            '.' => Ok(Node::Any),
            '^' => Ok(Node::Begin),
            '$' => Ok(Node::End),
            '*' | '+' | '?' => Err(format!("missing argument to repetition operator {c:?}")),
            '\\' => {
                let class = self.parse_escape(false)?;
                Ok(Node::Class(class))
            }
            '{' => {
                // A `{` that is not a counted repetition is a literal.
                Ok(Node::Class(Class::single('{')))
            }
            other => Ok(Node::Class(Class::single(other))),
        }
    }

    /// After a backslash. Returns the set of characters the escape stands for.
    fn parse_escape(&mut self, in_class: bool) -> Result<Class, String> {
        let Some(c) = self.peek() else {
            return Err("trailing backslash".into());
        };
        self.pos += 1;
        let perl = |ranges: Vec<(char, char)>, negated: bool| Class { ranges, negated };
        Ok(match c {
            'd' => perl(digit(), false),
            'D' => perl(digit(), true),
            'w' => perl(word(), false),
            'W' => perl(word(), true),
            's' => perl(space(), false),
            'S' => perl(space(), true),
            't' => Class::single('\t'),
            'n' => Class::single('\n'),
            'r' => Class::single('\r'),
            'f' => Class::single('\x0c'),
            'v' => Class::single('\x0b'),
            'a' => Class::single('\x07'),
            'x' => Class::single(self.parse_hex()?),
            '0' => Class::single('\0'),
            c if c.is_ascii_punctuation() => Class::single(c),
            'b' | 'B' | 'A' | 'z' if !in_class => {
                return Err(format!("assertion \\{c} is not supported"))
            }
            other => return Err(format!("escape \\{other} is not supported")),
        })
    }

    fn parse_hex(&mut self) -> Result<char, String> {
        let digits: String = if self.eat('{') {
            let s = self.pos;
            while self.peek().is_some_and(|c| c != '}') {
                self.pos += 1;
            }
            let d = self.chars[s..self.pos].iter().collect();
            if !self.eat('}') {
                return Err("missing } in \\x{...}".into());
            }
            d
        } else {
            let s = self.pos;
            self.pos = (self.pos + 2).min(self.chars.len());
            self.chars[s..self.pos].iter().collect()
        };
        u32::from_str_radix(&digits, 16)
            .ok()
            .and_then(char::from_u32)
            .ok_or_else(|| format!("bad hex escape \\x{digits}"))
    }

    fn parse_class(&mut self) -> Result<Class, String> {
        let negated = self.eat('^');
        let mut ranges = Vec::new();
        let mut first = true;
        loop {
            let Some(c) = self.peek() else {
                return Err("missing ]".into());
            };
            if c == ']' && !first {
                self.pos += 1;
                break;
            }
            first = false;
            if c == '[' && self.chars.get(self.pos + 1) == Some(&':') {
                return Err("POSIX classes [:name:] are not supported".into());
            }
            self.pos += 1;
            let lo = if c == '\\' {
                let class = self.parse_escape(true)?;
                if class.negated
                    || class.ranges.len() != 1
                    || class.ranges[0].0 != class.ranges[0].1
                {
                    // A Perl class inside brackets: add its ranges (negated ones are rare here).
                    if class.negated {
                        return Err("negated Perl class inside [] is not supported".into());
                    }
                    ranges.extend(class.ranges);
                    continue;
                }
                class.ranges[0].0
            } else {
                c
            };
            // A range `a-z`, unless `-` is the last character before `]`.
            if self.peek() == Some('-') && self.chars.get(self.pos + 1).is_some_and(|&n| n != ']') {
                self.pos += 1;
                let Some(h) = self.peek() else {
                    return Err("missing ]".into());
                };
                self.pos += 1;
                let hi = if h == '\\' {
                    let class = self.parse_escape(true)?;
                    if class.negated || class.ranges.len() != 1 {
                        return Err("bad range end".into());
                    }
                    class.ranges[0].0
                } else {
                    h
                };
                if hi < lo {
                    return Err(format!("invalid range {lo}-{hi}"));
                }
                ranges.push((lo, hi));
            } else {
                ranges.push((lo, lo));
            }
        }
        Ok(Class { ranges, negated })
    }
}

fn digit() -> Vec<(char, char)> {
    vec![('0', '9')]
}

fn word() -> Vec<(char, char)> {
    vec![('0', '9'), ('A', 'Z'), ('_', '_'), ('a', 'z')]
}

fn space() -> Vec<(char, char)> {
    vec![('\t', '\n'), ('\x0c', '\r'), (' ', ' ')]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(pattern: &str, text: &str) -> bool {
        Regex::new(pattern).unwrap().is_match(text)
    }

    #[test]
    fn anchors_and_search() {
        assert!(m("abc", "xxabcxx"));
        assert!(!m("^abc", "xabc"));
        assert!(m("^abc$", "abc"));
        assert!(!m("^abc$", "abcd"));
        assert!(m("", "anything"));
        assert!(m("^$", ""));
        assert!(!m("^$", "a"));
    }

    #[test]
    fn dns_subdomain_pattern() {
        let p = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
        for ok in [
            "",
            "a",
            "example.com",
            "a-b.c-d",
            "inference.networking.k8s.io",
        ] {
            assert!(m(p, ok), "{ok}");
        }
        for bad in ["-a", "a-", "A", "a..b", "a_b", ".a", "a."] {
            assert!(!m(p, bad), "{bad}");
        }
    }

    #[test]
    fn classes_escapes_and_counts() {
        assert!(m(r"^[A-Za-z0-9!#$%&'*+\-.^_\x60|~]+$", "x-foo_bar`"));
        assert!(!m(r"^[A-Za-z0-9!#$%&'*+\-.^_\x60|~]+$", "a b"));
        assert!(m(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$", "1h30m"));
        assert!(!m(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$", "123456s"));
        assert!(!m(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$", "1h1h1h1h1h"));
        assert!(m(r"^[^\x00\n\r]*$", "tab\tok"));
        assert!(!m(r"^[^\x00\n\r]*$", "new\nline"));
        assert!(m(
            r"^(?:[-A-Za-z0-9/._~!$&'()*+,;=:@]|[%][0-9a-fA-F]{2})+$",
            "/a%20b"
        ));
        assert!(!m(
            r"^(?:[-A-Za-z0-9/._~!$&'()*+,;=:@]|[%][0-9a-fA-F]{2})+$",
            "/a%2"
        ));
        assert!(m(r"^[\d\w]+$", "a_1"));
        assert!(m(r"(^$|^[a-f0-9]{64}$)", ""));
        assert!(
            m(r"a{,2}", "a{,2}"),
            "a brace that is not a count is a literal"
        );
        assert!(!m("a.b", "a\nb"));
    }

    #[test]
    fn nested_stars_stay_linear() {
        let p = r"^(a*)*$";
        let text = "a".repeat(5000) + "b";
        assert!(!m(p, &text));
    }

    #[test]
    fn refuses_what_it_cannot_do() {
        for p in [
            r"(?i)abc",
            r"(?=a)",
            r"\1",
            r"\bword",
            "[[:alpha:]]",
            "(",
            "a)",
            "*a",
        ] {
            assert!(Regex::new(p).is_err(), "{p}");
        }
    }
}
