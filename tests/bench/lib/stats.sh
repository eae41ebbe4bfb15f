# The benches' summary of a row of timings (seconds), sourced:
#   median 1.2 0.9 1.4      # 1.2
#   range 1.2 0.9 1.4       # 0.9-1.4
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
range() { printf '%s\n' "$@" | sort -g | awk 'NR==1{lo=$1} {hi=$1} END {print lo "-" hi}'; }
