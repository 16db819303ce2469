"""`ultractl completion bash|zsh|fish`: shell completion generated from the argument parser.

The script is derived from the live argparse tree, so a new command or flag is completed
without anyone editing the script. For each command path (`""`, `job`, `job submit`, ...)
it records the words that may follow (sub-commands, positional choices), the options, and which
options take a value; option values complete from their choices, else as file names.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass

SHELLS = ("bash", "zsh", "fish")


@dataclass(frozen=True)
class Level:
    """What may follow a command path."""
    path: str                      # "" for the top level, else "job submit"
    words: tuple[str, ...]         # sub-commands and positional choices
    options: tuple[str, ...]
    valued: tuple[str, ...]        # options that take a value
    choices: tuple[tuple[str, tuple[str, ...]], ...]   # option -> its choices


_OFFERED = "completion_choices"


def offer(action: argparse.Action, values: tuple[str, ...]) -> None:
    """Values to complete for an option whose command checks them itself (argparse's `choices`
    would print a usage error of several lines)."""
    setattr(action, _OFFERED, values)


def levels(parser: argparse.ArgumentParser, path: str = "") -> Iterator[Level]:
    words: list[str] = []
    options: list[str] = []
    valued: list[str] = []
    choices: list[tuple[str, tuple[str, ...]]] = []
    children: list[tuple[str, argparse.ArgumentParser]] = []
    for action in parser._actions:  # argparse exposes no public view of its actions
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                words.append(name)
                children.append((name, child))
        elif not action.option_strings:
            words.extend(str(c) for c in action.choices or ())
        elif action.help != argparse.SUPPRESS:
            options.extend(action.option_strings)
            if action.nargs != 0:
                valued.extend(action.option_strings)
                offered = action.choices or getattr(action, _OFFERED, ())
                if offered:
                    choices += [(o, tuple(str(c) for c in offered))
                                for o in action.option_strings]
    yield Level(path, tuple(words), tuple(options), tuple(valued), tuple(choices))
    for name, child in children:
        yield from levels(child, f"{path} {name}".strip())


def _case(name: str, arms: list[tuple[str, str]]) -> list[str]:
    """A shell function `name KEY` that prints the words for KEY (valid bash and zsh)."""
    lines = [f"{name}() {{", '    case "$1" in']
    lines += [f'        "{key}") echo "{value}" ;;' for key, value in arms]
    return lines + ["    esac", "}"]


def _tables(prog: str, parser: argparse.ArgumentParser) -> list[str]:
    fn = "_" + prog.replace("-", "_")
    all_levels = list(levels(parser))
    lines = _case(f"{fn}_words", [(lv.path, " ".join(lv.words)) for lv in all_levels])
    lines += _case(f"{fn}_options", [(lv.path, " ".join(lv.options)) for lv in all_levels])
    lines += _case(f"{fn}_valued", [(lv.path, " ".join(lv.valued)) for lv in all_levels])
    lines += _case(f"{fn}_choices", [(f"{lv.path}|{opt}", " ".join(values))
                                     for lv in all_levels for opt, values in lv.choices])
    return lines


# Walks the words before the cursor: options are skipped (with their value, when they take
# one), and a word that is a sub-command of the current path extends the path.
_WALK = """\
    local cmdpath="" w skip=0 i
    for ((i = {first}; i < {cword}; i++)); do
        w="{word}"
        if ((skip)); then skip=0; continue; fi
        case "$w" in
            -*=*) ;;
            -*) case " $({fn}_valued "$cmdpath") " in *" $w "*) skip=1 ;; esac ;;
            *) case " $({fn}_words "$cmdpath") " in
                   *" $w "*) cmdpath="${{cmdpath:+$cmdpath }}$w" ;;
               esac ;;
        esac
    done
"""

_BASH = """\
{fn}() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}"
{walk}    COMPREPLY=()
    if ((skip)); then
        local choices
        choices="$({fn}_choices "$cmdpath|$prev")"
        if [[ -n "$choices" ]]; then
            COMPREPLY=($(compgen -W "$choices" -- "$cur"))
        else
            COMPREPLY=($(compgen -f -- "$cur"))
        fi
    elif [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$({fn}_options "$cmdpath")" -- "$cur"))
    else
        COMPREPLY=($(compgen -W "$({fn}_words "$cmdpath")" -- "$cur"))
        [[ ${{#COMPREPLY[@]}} -eq 0 ]] && COMPREPLY=($(compgen -f -- "$cur"))
    fi
    return 0
}}
complete -F {fn} {prog}
"""

_ZSH = """\
{fn}() {{
    local cur="${{words[CURRENT]}}" prev="${{words[CURRENT-1]}}"
{walk}    if ((skip)); then
        local choices
        choices="$({fn}_choices "$cmdpath|$prev")"
        if [[ -n "$choices" ]]; then
            compadd -- ${{=choices}}
        else
            _files
        fi
    elif [[ "$cur" == -* ]]; then
        compadd -- ${{=$({fn}_options "$cmdpath")}}
    else
        local next="$({fn}_words "$cmdpath")"
        if [[ -n "$next" ]]; then compadd -- ${{=next}}; else _files; fi
    fi
}}
if (( $+functions[compdef] )); then
    compdef {fn} {prog}
fi
"""


def _fish_switch(name: str, arms: list[tuple[str, str]]) -> list[str]:
    """A fish function `name KEY` that prints the words for KEY."""
    lines = [f"function {name}", "    switch $argv[1]"]
    for key, value in arms:
        lines += [f"        case {_fish_quote(key)}", f"            echo {_fish_quote(value)}"]
    return lines + ["    end", "end"]


def _fish_quote(text: str) -> str:
    # Keys and words are command, option and choice names: no quote or backslash in them, but
    # a `case` pattern would treat * and ? as wildcards, which single quotes do not prevent.
    if any(c in text for c in "'\\*?"):
        raise ValueError(f"completion: cannot quote {text!r} for fish")
    return f"'{text}'"


_FISH = """\
function {fn}
    set -l tokens (commandline -opc)
    set -l cur (commandline -ct)
    set -l cmdpath ''
    set -l skip 0
    set -l prev ''
    for w in $tokens[2..-1]
        set prev $w
        if test $skip -eq 1
            set skip 0
            continue
        end
        switch $w
            case '-*=*'
            case '-*'
                if contains -- $w (string split -n ' ' -- ({fn}_valued $cmdpath))
                    set skip 1
                end
            case '*'
                if contains -- $w (string split -n ' ' -- ({fn}_words $cmdpath))
                    set cmdpath (string trim -- "$cmdpath $w")
                end
        end
    end
    if test $skip -eq 1
        set -l choices ({fn}_choices "$cmdpath|$prev")
        if test -n "$choices"
            string split -n ' ' -- $choices
        else
            __fish_complete_path $cur
        end
    else if string match -q -- '-*' $cur
        string split -n ' ' -- ({fn}_options $cmdpath)
    else
        set -l next ({fn}_words $cmdpath)
        if test -n "$next"
            string split -n ' ' -- $next
        else
            __fish_complete_path $cur
        end
    end
end
complete -c {prog} -f -a '({fn})'
"""


def _fish(prog: str, parser: argparse.ArgumentParser) -> str:
    fn = "__" + prog.replace("-", "_") + "_complete"
    all_levels = list(levels(parser))
    lines = [f"# fish completion for {prog}: {prog} completion fish | source, or save it as "
             f"~/.config/fish/completions/{prog}.fish"]
    lines += _fish_switch(f"{fn}_words", [(lv.path, " ".join(lv.words)) for lv in all_levels])
    lines += _fish_switch(f"{fn}_options", [(lv.path, " ".join(lv.options))
                                            for lv in all_levels])
    lines += _fish_switch(f"{fn}_valued", [(lv.path, " ".join(lv.valued)) for lv in all_levels])
    lines += _fish_switch(f"{fn}_choices", [(f"{lv.path}|{opt}", " ".join(values))
                                            for lv in all_levels for opt, values in lv.choices])
    return "\n".join([*lines, _FISH.format(fn=fn, prog=prog)])


def script(shell: str, prog: str, parser: argparse.ArgumentParser) -> str:
    fn = "_" + prog.replace("-", "_")
    if shell == "bash":
        head = [f"# bash completion for {prog}: source <({prog} completion bash)"]
        walk = _WALK.format(first=1, cword="COMP_CWORD", word="${COMP_WORDS[i]}", fn=fn)
        body = _BASH.format(fn=fn, prog=prog, walk=walk)
    elif shell == "zsh":
        head = [f"#compdef {prog}",
                f"# zsh completion for {prog}: source <({prog} completion zsh), or save it as "
                f"_{prog} in a directory of $fpath"]
        # zsh arrays start at 1 and words[1] is the command itself.
        walk = _WALK.format(first=2, cword="CURRENT", word="${words[i]}", fn=fn)
        body = _ZSH.format(fn=fn, prog=prog, walk=walk)
    elif shell == "fish":
        return _fish(prog, parser)
    else:
        raise ValueError(f"completion: unknown shell {shell!r} (known: {', '.join(SHELLS)})")
    return "\n".join([*head, *_tables(prog, parser), body])
